"""What crosses the socket between engines and the server: the protocol's messages (`protocol`), packed
integers (`packed`), the wire formats and their traits (`wire_formats`), where a server listens
(`endpoints`). Imports only hybridkv.model below it."""

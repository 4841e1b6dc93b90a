"""The front door: the event loop and its sockets (connections, lifecycle), the command line and how a server is
launched, logging, the metrics endpoint. Only this layer reads the process's environment and argv; it imports
everything below it (ops, books, l2/, machinery)."""

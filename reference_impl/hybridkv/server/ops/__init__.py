"""The request handlers, one module per request (admin, clear, lookup, prefetch, retrieve, store) and what they
share: the Context every handler is given, the hit rule and the turns a large request works in. Ops import the
books, l2/ and the machinery, never the front door."""

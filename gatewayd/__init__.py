"""gatewayd: Symphony's HTTP front door (program runs over HTTP/SSE, the OpenAI API,
/metrics). A client like any LIP: it uses liblip and `lip run --sandbox`, never predd or
kvfsd internals."""

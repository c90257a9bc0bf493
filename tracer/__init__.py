"""decodescope tracer: capture traces of a workload and ingest trace files into the store."""

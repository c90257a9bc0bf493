"""decodescope analyzers: SQL-first analyses that read only the store (tracer/schema.sql)."""

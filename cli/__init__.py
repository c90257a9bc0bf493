"""The `decodescope` and `trace-diff` command lines: parse, call one library function, format."""

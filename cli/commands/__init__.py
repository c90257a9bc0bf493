"""One module per `decodescope` subcommand, each defining `command`."""

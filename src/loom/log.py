"""The log line of every loom process: the command line's, and the engine process's, which
`loom serve` starts with the same format."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

"""The `loom` command line, on top of everything else: each command's module reads its flags
into the libraries' dataclasses and calls a library function. Nothing below imports it."""

"""loom's benchmarks, by subject (kernels, engine, server, planning, peers): scripts to run
from the repository root, importing each other and `benchmarks.harness` as this package.
BENCHMARKS.md has the current figure of each and the command that measured it."""

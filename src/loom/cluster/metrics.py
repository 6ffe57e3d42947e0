"""One Prometheus scrape over many replicas: each replica's series gains a `replica` label and
each metric family is written once, with every replica's samples under it (the text format
wants a family's samples together)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

# The request router runs in the front end's process (where the deployment handle is called),
# so its counters are served by the front end's /metrics next to the replicas' series.
ROUTER_REGISTRY = CollectorRegistry()
ROUTER_DECISIONS = Counter("loom:router_decisions",
                           "Requests routed, by router, reason and replica",
                           ["router", "decision", "replica"], registry=ROUTER_REGISTRY)


def merge_replica_texts(texts: Mapping[str, bytes]) -> bytes:
    """{replica tag: that replica's Prometheus text} -> one text with `replica` labels."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        family = ""
        for line in text.decode().splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                if line not in headers.setdefault(family, []):
                    headers[family].append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#"):
                samples[family].append(_with_label(line, "replica", replica))
    out = []
    for family, header in headers.items():
        out.extend(header)
        out.extend(samples[family])
    return ("\n".join(out) + "\n").encode() if out else b""


def _with_label(line: str, name: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and brace < space:
        rest = line[brace + 1:]
        sep = "" if rest.startswith("}") else ","
        return f'{line[:brace]}{{{name}="{escaped}"{sep}{rest}'
    return f'{line[:space]}{{{name}="{escaped}"}}{line[space:]}'

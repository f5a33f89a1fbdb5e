"""`crew sync` and `crew run --sync` (being written)."""

from __future__ import annotations


def sync_nodes(nodes, paths, cwd, ssh_args, tool, say) -> None:
    raise NotImplementedError

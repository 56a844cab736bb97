"""``python -m stack.launch.dry_run CONFIG [--k8s OUTDIR]``: what a deployment would run.

Prints every command of a real-SGLang deployment with its environment, per node (the same text
as ``smetric up --dry-run``), or writes its Kubernetes manifests, without the CLI and without
starting anything. It is its own module because it needs both renderers: the per-node one
(``stack.launch.sglang``) and the Kubernetes one (``stack.launch.k8s``, itself built on the
first); living in either would make them import each other.
"""

from __future__ import annotations

import argparse

from stack.launch import replicas
from stack.launch.k8s import summary, write_k8s
from stack.launch.sglang import dry_run_text, load_yaml

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print the dry run of CONFIG (or, with --k8s, write its manifests); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m stack.launch.dry_run",
        description="print the per-node commands of a deployment (or write its Kubernetes manifests)",
    )
    ap.add_argument("config")
    ap.add_argument("--k8s", metavar="OUTDIR", help="write Kubernetes manifests there instead")
    a = ap.parse_args(argv)
    cfg = replicas.ensure_redis(load_yaml(a.config))  # as `smetric up` does
    if a.k8s:
        print(summary(write_k8s(cfg, a.k8s)), end="")
    else:
        print(dry_run_text(cfg), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

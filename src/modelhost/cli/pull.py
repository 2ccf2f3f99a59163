"""`modelhost pull hf.co/USER/REPO[:QUANT]`: a model from the Hugging Face hub into its shared
cache, where `modelhost ls` and a running server find it (residency/pull/puller.py).

Progress goes to stderr: huggingface_hub's bars (one per file, named) on a terminal,
elsewhere a line per step and per file. The pulled model's id goes to stdout. Exit 1 on a
refusal or failure (the reason on stderr), 130 when interrupted (nothing that lists as a model
is left behind)."""

from __future__ import annotations

import argparse
import sys


def add_pull_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pull",
        help="download a model from the Hugging Face hub (GGUF by quantization, or safetensors)",
        description="Download hf.co/USER/REPO[:QUANT] into the Hugging Face cache (HF_HOME; "
        "HF_TOKEN for gated repos, HF_ENDPOINT for a mirror). A GGUF repo gives the file "
        "of QUANT (default Q4_K_M); a safetensors repo, the files a model needs.",
    )
    parser.add_argument(
        "model", metavar="REPO[:QUANT]", help="say, bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M"
    )
    return parser


def run_pull(args: argparse.Namespace) -> int:
    from modelhost.residency.pull.puller import PullProgress, fetch, prepare
    from modelhost.residency.pull.reference import PullError

    terminal = sys.stderr.isatty()
    said: set[str] = set()

    def report(progress: PullProgress) -> None:
        # File progress is the bar's on a terminal; elsewhere one line as a file starts.
        if progress.digest is not None and (terminal or progress.status in said):
            return
        said.add(progress.status)
        shown = f"pulling {progress.file}" if progress.file else progress.status
        extra = f" ({progress.total / 1e6:.1f} MB)" if progress.total is not None else ""
        print(f"{shown}{extra}", file=sys.stderr, flush=True)

    try:
        plan = prepare(args.model, report)
        fetch(plan, report, show_bars=terminal)
    except PullError as error:
        print(f"modelhost pull: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nmodelhost pull: cancelled; nothing was kept", file=sys.stderr)
        return 130
    print("success", file=sys.stderr)
    print(plan.model_id)
    return 0

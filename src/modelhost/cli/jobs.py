"""`modelhost jobs ls | show ID | follow ID | cancel ID | submit KIND [CONFIG]`: a running
server's jobs, over its /api/jobs routes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the command alone: `serve` parses with this parser too
    import httpx

BAR_WIDTH = 20


def add_jobs_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("jobs", help="list, follow and cancel a server's jobs")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    actions = parser.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="recent jobs, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--kind", default=None)
    for name, text in (
        ("show", "one job's row"),
        ("follow", "stream a job's events until it ends"),
        ("cancel", "stop a queued or running job"),
    ):
        actions.add_parser(name, help=text).add_argument("job_id", metavar="ID")
    submit = actions.add_parser("submit", help="start a job: KIND and a JSON config")
    submit.add_argument("kind", help="bench-serve, eval-serve or convert")
    submit.add_argument("config", nargs="?", default="{}", help="JSON object")
    submit.add_argument("--follow", action="store_true", help="then follow it")
    return parser


def progress_bar(progress: float) -> str:
    filled = round(max(0.0, min(1.0, progress)) * BAR_WIDTH)
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {progress * 100:3.0f}%"


def job_line(job: dict[str, Any]) -> str:
    status = job["status"]
    detail = job.get("error") or job.get("message") or ""
    if status == "running":
        detail = f"{progress_bar(job.get('progress') or 0.0)} {detail}".rstrip()
    return f"{job['id']}  {job['kind']:<11}  {status:<7}  {job['started_at']}  {detail}"


def event_line(event: dict[str, Any]) -> str:
    kind = event.get("type")
    if kind == "log":
        return str(event.get("line", ""))
    if kind == "done":
        summary = event.get("summary")
        lines = ["done" + (f": {event['output_dir']}" if event.get("output_dir") else "")]
        if isinstance(summary, str):
            lines.append(summary)
        return "\n".join(lines)
    if kind == "failed":
        return f"failed: {event.get('error')}"
    text = {k: v for k, v in event.items() if k not in ("type", "progress", "message")}
    head = (
        progress_bar(event["progress"]) + " "
        if isinstance(event.get("progress"), int | float)
        else ""
    )
    message = event.get("message") or ""
    fields = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in text.items()
        if not isinstance(v, dict | list) and v is not None
    )
    return f"{head}{kind}: {message} {fields}".rstrip()


def run_jobs(args: argparse.Namespace) -> int:
    import httpx

    base = args.url.rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(30.0, read=None)  # a followed job may be quiet for long
    try:
        with httpx.Client(base_url=base, timeout=timeout, headers=headers) as client:
            return _ACTIONS[args.action](client, args)
    except httpx.HTTPError as exc:
        print(f"modelhost jobs: cannot reach {base}: {exc}", file=sys.stderr)
        return 1


def _answer(response: httpx.Response) -> dict[str, Any] | None:
    body = response.json()
    if response.status_code >= 400 or not body.get("ok"):
        print(f"modelhost jobs: {body.get('error', response.status_code)}", file=sys.stderr)
        return None
    return body


def _ls(client: httpx.Client, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.kind:
        params["kind"] = args.kind
    body = _answer(client.get("/api/jobs", params=params))
    if body is None:
        return 1
    for job in body["jobs"]:
        print(job_line(job))
    return 0


def _show(client: httpx.Client, args: argparse.Namespace) -> int:
    body = _answer(client.get(f"/api/jobs/{args.job_id}"))
    if body is None:
        return 1
    print(json.dumps(body["job"], indent=2))
    return 0


def _cancel(client: httpx.Client, args: argparse.Namespace) -> int:
    body = _answer(client.post(f"/api/jobs/{args.job_id}/cancel"))
    if body is None:
        return 1
    print(job_line(body["job"]))
    return 0


def _follow(client: httpx.Client, args: argparse.Namespace) -> int:
    return follow(client, args.job_id)


def follow(client: httpx.Client, job_id: str) -> int:
    """Print each event until `end`; exit 0 when the job is done, 1 otherwise."""
    outcome = 1
    with client.stream("GET", f"/api/jobs/{job_id}/stream") as response:
        if response.status_code != 200:
            response.read()
            return 0 if _answer(response) else 1
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if not event:  # the `end` frame's empty object
                break
            print(event_line(event), flush=True)
            if event.get("type") == "done":
                outcome = 0
    return outcome


def _submit(client: httpx.Client, args: argparse.Namespace) -> int:
    try:
        config = json.loads(args.config)
    except ValueError:
        print("modelhost jobs: CONFIG must be a JSON object", file=sys.stderr)
        return 2
    body = _answer(client.post("/api/jobs", json={"kind": args.kind, "config": config}))
    if body is None:
        return 1
    print(body["job"]["id"])
    return follow(client, body["job"]["id"]) if args.follow else 0


_ACTIONS = {
    "ls": _ls,
    "show": _show,
    "follow": _follow,
    "cancel": _cancel,
    "submit": _submit,
}

"""Worker processes: each resident model's, the spare kept warm for the next, and the fork server
that forks them."""

# The worker's entry (cli/worker.py: its main, and the warm_up a spare or the fork server runs
# ahead), named here so that `modelhost serve` can start the fork server before it imports the
# serving code.
WORKER_MODULE = "modelhost.cli.worker"

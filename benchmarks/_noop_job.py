"""The 16-rank job of `benchmarks/launch.py --runners`: no import beyond os, print the rank, exit."""

import os

print("BENCH_RANK", os.environ["RANK"])

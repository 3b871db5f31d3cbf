"""Prints the issues' targets against one or more bench.py result files (kept for the old
command; the summary lives in bench_report.py and is printed last by bench.py):

    python3 benchmarks/targets.py benchmarks/results/<date>-h200-fwd.json [<...>-train.json]

Per shape and pass: effective TFLOP/s of ours, cuDNN, FA3 and XLA, ours over the best of cuDNN
and FA3, the target (forward: issue 11, with 640 TFLOP/s absolute on d128-full; train: issue
12; prefill-right-padded, forward and train: issue 31, >= 1.2x cuDNN) and whether it is met.
The targets themselves are bench_report.RATIO_TARGETS, ABSOLUTE_TARGETS and TARGET_PEERS.
"""

import sys

import bench_report

if __name__ == "__main__":
    bench_report.main(sys.argv[1:])

"""Write a tiny random DeepSeek-V4-Flash / V4.1-Flash checkpoint in the real on-disk layout.

    python tools/make_tiny_checkpoint.py --arch v41-flash --out /tmp/tiny41
    python tools/make_tiny_checkpoint.py --arch v4-flash --out /tmp/tiny4 --dequantized

See dsv4/tiny.py for what the checkpoint holds.
"""

from __future__ import annotations

import argparse
import sys

from dsv4.tiny import ARCHS, make_tiny_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--dequantized",
        action="store_true",
        help="the twin: no quantization_config, quantized weights stored as their exact F32 dequantization",
    )
    args = p.parse_args(argv)
    print(make_tiny_checkpoint(args.arch, args.out, seed=args.seed, dequantized=args.dequantized))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed's cost model (Leviathan et al. 2023, sec. 3.1), computed with ``jspec.cost_model``.

    python examples/cost_model.py                      # the seed's table
    python examples/cost_model.py --alpha 0.7 --draft-ms 1.5
    python examples/cost_model.py --accept-at 0.9,0.8,0.7,0.6 --draft-ms 1 --verify-ms 12 --state-ms 2 \\
        --baseline-ms 10 --measured-speedup 1.5

With neither --alpha nor --accept-at it prints the seed's two rows (baseline 10 ms/token, gamma=4, verify
12 ms, state 2 ms; alpha=0.8 with 1 ms draft steps, alpha=0.9 with 3 ms). Otherwise it prints one prediction
from the given (ideally measured) acceptance and costs.
"""

from __future__ import annotations

import argparse

from jspec.cost_model import predict

SEED_ROWS = ((0.8, 1.0), (0.9, 3.0))  # (alpha, ms per draft step)


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated probabilities, got {text!r}") from e


def _row(label: str, r) -> str:
    return (
        f"{label}: E[N]={r.expected_tokens:.4f}, cycle {r.cycle_ms:g} ms, {r.ms_per_token:.3f} ms/token, "
        f"speedup {r.speedup:.3f}x"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--alpha", type=float, help="i.i.d. acceptance probability of every candidate")
    src.add_argument("--accept-at", type=_rates, help="measured conditional acceptance per draft position, a1,a2,...")
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default 4, or len(--accept-at))")
    ap.add_argument(
        "--draft-ms",
        type=float,
        default=None,
        help="ms per draft step (default 1; the seed table, without --alpha/--accept-at, uses its rows' 1 and 3 ms)",
    )
    ap.add_argument("--verify-ms", type=float, default=12.0, help="ms per verification call")
    ap.add_argument("--state-ms", type=float, default=2.0, help="ms per state update")
    ap.add_argument("--baseline-ms", type=float, default=10.0, help="plain decoding ms per token")
    ap.add_argument("--measured-speedup", type=float, default=None, help="print predicted / measured")
    args = ap.parse_args(argv)
    # Refused here, by name, rather than ignored (--measured-speedup) or ending in a traceback (--gamma).
    if args.measured_speedup is not None and args.alpha is None and args.accept_at is None:
        ap.error("--measured-speedup needs --alpha or --accept-at (the seed table has no single prediction)")
    if args.accept_at is not None and args.gamma is not None and args.gamma > len(args.accept_at):
        ap.error(
            f"--gamma {args.gamma} needs acceptance rates for {args.gamma} positions, --accept-at gives "
            f"{len(args.accept_at)}"
        )
    try:
        _print_predictions(args)
    except ValueError as e:  # the model's own checks (a rate outside [0, 1], gamma < 0, ...): name it, no traceback
        ap.error(str(e))


def _print_predictions(args) -> None:
    costs = f"verify {args.verify_ms:g} ms, state {args.state_ms:g} ms"
    if args.alpha is None and args.accept_at is None:
        gamma = 4 if args.gamma is None else args.gamma
        print(f"seed table: baseline {args.baseline_ms:g} ms/token, gamma={gamma}, {costs}")
        for alpha, d in SEED_ROWS:
            d = d if args.draft_ms is None else args.draft_ms
            r = predict(
                baseline_ms_per_token=args.baseline_ms,
                draft_ms=d,
                verify_ms=args.verify_ms,
                state_ms=args.state_ms,
                gamma=gamma,
                alpha=alpha,
            )
            print(_row(f"alpha={alpha:g}, d={d:g} ms", r))
        return

    d = 1.0 if args.draft_ms is None else args.draft_ms
    if args.alpha is not None:
        gamma = 4 if args.gamma is None else args.gamma
        r = predict(
            baseline_ms_per_token=args.baseline_ms,
            draft_ms=d,
            verify_ms=args.verify_ms,
            state_ms=args.state_ms,
            gamma=gamma,
            alpha=args.alpha,
        )
        label = f"alpha={args.alpha:g}, d={d:g} ms"
    else:
        r = predict(
            baseline_ms_per_token=args.baseline_ms,
            draft_ms=d,
            verify_ms=args.verify_ms,
            state_ms=args.state_ms,
            gamma=args.gamma,
            accept_at=args.accept_at,
        )
        label = f"accept_at={[round(a, 4) for a in r.accept_at]}, d={d:g} ms"
    print(f"prediction: baseline {args.baseline_ms:g} ms/token, gamma={r.gamma}, {costs}")
    print(_row(label, r))
    if args.measured_speedup is not None:
        ratio = r.ratio_to(args.measured_speedup)
        print(f"measured speedup {args.measured_speedup:.3f}x, predicted / measured {ratio:.3f}")


if __name__ == "__main__":
    main()

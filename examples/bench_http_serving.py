"""Serving over HTTP: plain and n-gram ``python -m jspec serve`` under Poisson arrivals, driven over loopback, and
the in-process runner at the same rates (the HTTP path's overhead), in one run (``jspec.bench.http_bench``).

    python examples/bench_http_serving.py --rates 1,2 --n 50 [--rows 8] [--record docs/results/NAME.json]
"""

from jspec.bench.http_bench import main

if __name__ == "__main__":
    raise SystemExit(main())

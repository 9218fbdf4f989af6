"""The seed's worked example (Leviathan et al. 2023, sec. 2.3), every number computed by jspec itself.

Vocabulary A, B, C; target p = (0.5, 0.3, 0.2); proposer q = (0.6, 0.1, 0.3). Then a replay of one round:
draft A, C, B with accept uniforms 0.7, 0.9, 0.2 and final draw 0.2 through ``jspec.verify.verify_chain``.

    python examples/seed_example.py
"""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
import numpy as np

from jspec.sampling import sample_from
from jspec.verify import acceptance_prob, accepted_mass, residual, verify_chain

VOCAB = ("A", "B", "C")
P = (0.5, 0.3, 0.2)
Q = (0.6, 0.1, 0.3)
DRAFT = ("A", "C", "B")
U_ACCEPT = (0.7, 0.9, 0.2)
U_FINAL = 0.2


def _vec(x, digits: int = 4) -> list[float]:
    # float32 carries ~1e-7 noise (0.30000001); rounding shows the exact values the maths gives.
    return [round(float(v), digits) + 0.0 for v in np.asarray(x)]  # + 0.0 turns -0.0 into 0.0


def _frac(x: float) -> str:
    return str(Fraction(round(float(x), 6)).limit_denominator(100))


def main() -> None:
    p = jnp.asarray(P, jnp.float32)  # [V]
    q = jnp.asarray(Q, jnp.float32)  # [V]
    a = acceptance_prob(p, q)
    mass = accepted_mass(p, q)
    acceptance = jnp.sum(mass)
    r = residual(p, q)
    recon = mass + (1.0 - acceptance) * r

    print(f"vocabulary {list(VOCAB)}, p {_vec(p)}, q {_vec(q)}")
    print(f"acceptance probabilities {_vec(a, 3)} = {', '.join(_frac(x) for x in np.asarray(a))}")
    print(f"accepted mass {_vec(mass)}")
    print(f"acceptance {round(float(acceptance), 4)}")
    print(f"residual {_vec(r)}")
    print(f"reconstructed {_vec(recon)}")

    # One chain of K = 3 proposals, same p and q at every position (p has K + 1 rows: the bonus position).
    k = len(DRAFT)
    draft = jnp.asarray([[VOCAB.index(t) for t in DRAFT]], jnp.int32)  # [1, K]
    res = verify_chain(
        jnp.broadcast_to(p, (1, k + 1, p.shape[0])),  # [B=1, K+1, V]
        jnp.broadcast_to(q, (1, k, q.shape[0])),  # [B=1, K, V]
        draft,
        jnp.asarray([k], jnp.int32),  # n_draft [1]
        jnp.asarray([U_ACCEPT], jnp.float32),  # [1, K]
        jnp.asarray([U_FINAL], jnp.float32),  # [1]
    )
    n_acc = int(res.n_accepted[0])
    accepted = np.asarray(res.accepted[0])
    a_draft = np.asarray(a)[np.asarray(draft[0])]
    print(f"replay: draft {list(DRAFT)}, uniforms {list(U_ACCEPT)}, final draw {U_FINAL}")
    # Only the leading run of accept tests matters: the chain stops at the first rejection.
    for i in range(min(n_acc + 1, k)):
        verdict = "accepted" if accepted[i] else "rejected"
        sign = "<" if accepted[i] else ">="
        print(f"{DRAFT[i]} {verdict} ({U_ACCEPT[i]} {sign} {round(float(a_draft[i]), 3)})")
    print(f"discard {list(DRAFT[n_acc:])}")
    if n_acc < k:
        # The correction is the inverse-CDF draw from the residual at the rejected position; the chain
        # must agree with drawing it directly from jspec's residual.
        direct = int(sample_from(r, jnp.asarray(U_FINAL, jnp.float32)))
        assert direct == int(res.next_token[0]), (direct, int(res.next_token[0]))
        print(f"correction drawn from the residual = {VOCAB[int(res.next_token[0])]}")
    else:
        print(f"bonus drawn from p = {VOCAB[int(res.next_token[0])]}")
    print(f"emit {list(DRAFT[:n_acc]) + [VOCAB[int(res.next_token[0])]]}")
    if n_acc < k and DRAFT[-1] == VOCAB[int(res.next_token[0])]:
        print(
            f"note: the discarded {DRAFT[-1]} equals the correction but is not kept: "
            f"its state depended on the prefix {', '.join(DRAFT[: n_acc + 1])}"
        )


if __name__ == "__main__":
    main()

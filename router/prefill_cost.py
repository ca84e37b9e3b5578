"""Whether a prompt's prefill is cheaper on its decode worker or on a prefill worker, from
the costs the workers measure (each engine's seconds per token, cluster/engine/sched/step_rate.py,
and each prefill worker's seconds per token pushed).

For a request whose decode worker d lacks U_d of the prompt's tokens and whose prefill
worker p lacks U_p of them:

    local(d)  = U_d * spt(d) * (1 + sequences(d))
                the request waits for its U_d tokens, and so does each sequence already
                on d (running or waiting), whose steps grow by as much
    remote(p) = (queued(p) + U_p) * spt(p) + U_d * transfer(p)
                the prompt tokens ahead of it in p's queue and its own, then pushing the
                U_d tokens d lacks

It prefills remotely iff remote(p) < local(d), or when a cost is not measured yet (a
worker that has not run steps of different sizes, or a prefill worker that has pushed
nothing): the disaggregated default.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefill:
    uncached: int  # U_d: prompt tokens the decode worker would compute
    s_per_token: float | None  # spt(d), None: not measured
    sequences: int  # running or waiting on the decode worker, each stalled meanwhile


@dataclass(frozen=True)
class RemotePrefill:
    uncached: int  # U_p: prompt tokens the prefill worker would compute
    queued_tokens: int  # prompt tokens ahead of it there
    s_per_token: float | None  # spt(p), None: not measured
    transfer_s_per_token: float | None  # transfer(p), None: not measured
    pushed: int  # U_d: prompt tokens it would push to the decode worker


def local_seconds(local: LocalPrefill) -> float | None:
    if local.s_per_token is None:
        return None
    return local.uncached * local.s_per_token * (1 + local.sequences)


def remote_seconds(remote: RemotePrefill) -> float | None:
    if remote.s_per_token is None or remote.transfer_s_per_token is None:
        return None
    compute = (remote.queued_tokens + remote.uncached) * remote.s_per_token
    return compute + remote.pushed * remote.transfer_s_per_token


def prefill_remotely(local: LocalPrefill, remote: RemotePrefill) -> bool:
    """True when the prefill worker is cheaper, or a cost is unknown (see the module)."""
    here, there = local_seconds(local), remote_seconds(remote)
    return here is None or there is None or there < here

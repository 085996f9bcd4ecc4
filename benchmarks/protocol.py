"""The timing protocol of a results file in words, as the generated tables state it (no torch)."""


def replays_phrase(env: dict, reps_default="?") -> str:
    """``median of N CUDA-graph replays`` and, where the run settled the board first, how long
    each path and the limit were replayed before timing (``env``: a results file's ``env``)."""
    settle = f", each path and the limit first replayed for {env['settle_s']:g} s" if env.get("settle_s") else ""
    return f"median of {env.get('reps', reps_default)} CUDA-graph replays{settle}"

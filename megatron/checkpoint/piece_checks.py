"""What a piece of ``metadata.json`` may hold: a crafted or damaged one must not steer a read outside the step
folder, allocate without bound, or leave part of a tensor unread while its element count adds up."""

from __future__ import annotations

KINDS = ("param", "exp_avg", "exp_avg_sq", "momentum_buffer")  # param: the fp32 master weight; Muon's momentum
MAX_TP = 1 << 16


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def wrong_field(piece: dict) -> str | None:
    """The first field of a piece whose type or value the format never writes (a crafted metadata.json must
    not steer a read outside the step folder, or fail as a traceback), else None."""
    for field in ("offset", "rank", "lo", "hi", "tp_rank", "tp_size"):
        if not _is_count(piece[field]):
            return field
    if piece["kind"] not in KINDS:
        return "kind"
    if not isinstance(piece["name"], str):
        return "name"
    for field in ("global_shape", "local_shape"):
        if not isinstance(piece[field], list) or not all(_is_count(n) for n in piece[field]):
            return field
    dim = piece["partition_dim"]
    if dim is not None and not (_is_count(dim) and dim < len(piece["global_shape"])):
        return "partition_dim"
    if not 1 <= piece["tp_size"] <= MAX_TP or piece["tp_rank"] >= piece["tp_size"]:
        return "tp_size" if not 1 <= piece["tp_size"] <= MAX_TP else "tp_rank"
    return None


def overlap(pieces: list) -> str | None:
    """A sentence when two pieces of one tensor slice cover the same elements (each element is written once:
    a repeated piece would leave another range unread while the count of elements still adds up)."""
    ranges: dict[tuple, list[tuple[int, int]]] = {}
    for piece in pieces:
        ranges.setdefault((piece["kind"], piece["name"], piece["tp_rank"]), []).append((piece["lo"], piece["hi"]))
    for (kind, name, _), spans in ranges.items():
        spans.sort()
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            return f"two pieces of {kind} {name!r} cover the same elements"
    return None

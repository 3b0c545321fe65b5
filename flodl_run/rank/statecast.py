"""One member's training state sent to every member of the group: parameters, float buffers,
the optimizer's state and the schedule's position.

nccl_sync's exact path uses it after a regroup, when a death inside a step's all-reduce left
one survivor a step ahead of another. The structure of the optimizer's state travels as JSON
in a byte tensor (no pickle between ranks), its tensors as broadcasts over the group.
"""

from __future__ import annotations

import json
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from flodl_run.averaging.flat import FlatParams
from flodl_run.rank.replica import Replica


def broadcast_state_(replica: Replica, flat: FlatParams, source: int, device: torch.device) -> None:
    """Every member of the default group leaves with `source`'s state (collective: all call it)."""
    for buffer in flat.buffers:
        dist.broadcast(buffer, src=source)
    for buffer in flat.float_buffers:
        dist.broadcast(buffer, src=source)
    mine = dist.get_rank() == source
    skeleton, tensors = _split(replica.optimizer.state_dict()) if mine else (None, [])
    position = replica.scheduler.last_epoch if replica.scheduler is not None else 0
    header = _broadcast_json({"skeleton": skeleton, "position": position, "steps": replica.steps,
                              "tensors": [_describe(t) for t in tensors]}, source, device)
    if not mine:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype),
                               device=device if where.startswith("cuda") else "cpu")
                   for dtype, shape, where in header["tensors"]]
    for tensor in tensors:
        _broadcast_anywhere(tensor, source, device)
    if not mine:
        replica.optimizer.load_state_dict(_join(header["skeleton"], tensors))
        replica.seek_schedule(header["position"])
        replica.steps = header["steps"]


def _describe(tensor: torch.Tensor) -> Tuple[str, List[int], str]:
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), str(tensor.device)


def _broadcast_anywhere(tensor: torch.Tensor, source: int, device: torch.device) -> None:
    """Broadcast `tensor` in place; one on another device than the group's (an optimizer's
    step count on the CPU under NCCL) travels through a copy on the group's device."""
    if tensor.device == device or device.type == "cpu":
        dist.broadcast(tensor, src=source)
        return
    carrier = tensor.to(device)
    dist.broadcast(carrier, src=source)
    tensor.copy_(carrier)


def _broadcast_json(value: Any, source: int, device: torch.device) -> Any:
    """`source`'s JSON-able value on every member (length first, then the bytes)."""
    mine = dist.get_rank() == source
    data = json.dumps(value).encode() if mine else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=source)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if mine:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src=source)
    return json.loads(bytes(payload.cpu().tolist())) if not mine else value


_TENSOR = "__tensor__"


def _split(value: Any) -> Tuple[Any, List[torch.Tensor]]:
    """A state dict as a JSON-able skeleton (tensors replaced by their index) and its tensors."""
    tensors: List[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(node, dict):
            return {"__keys__": [[walk(k), walk(v)] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        return node

    return walk(value), tensors


def _join(skeleton: Any, tensors: List[torch.Tensor]) -> Any:
    """The inverse of `_split`."""
    if isinstance(skeleton, dict) and _TENSOR in skeleton:
        return tensors[skeleton[_TENSOR]]
    if isinstance(skeleton, dict):
        return {_join(k, tensors): _join(v, tensors) for k, v in skeleton["__keys__"]}
    if isinstance(skeleton, list):
        return [_join(v, tensors) for v in skeleton]
    return skeleton

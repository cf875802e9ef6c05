"""The device side of the ``BlockTable``: its device tier (CUDA) and the copies on their way back to RAM.

Tiers hold different blocks: a block whose device copy a hit keeps leaves RAM (RAM holds what the device does
not), so the device and RAM budgets hold that many bytes of distinct blocks. A device copy evicted goes back to
RAM where the block is held nowhere else (device -> RAM, and from there to disk as RAM evicts): its host copy is
made off the engine's thread (``copy_back``, on the writer's), and until then it is still served from the device. A block
the disk holds, or will (its put is being written), needs no copy back. Made by the table with its index and
lock; the table's own steps call it under that lock."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import numpy as np

from ..blocks.ondevice import DeviceBlock
from ..blocks.wire import Stored
from ..tiers.device import DeviceTier
from .index import Node, RadixIndex

log = logging.getLogger("kvstore")


class DeviceSide:
    def __init__(self, index: RadixIndex, lock, budget: int, has_disk: bool,
                 take: Callable[[Node, Stored], None], forget: Callable[[Node], list[bytes]]):
        self._index = index
        self._lock = lock  # the table's
        self._tier = DeviceTier(budget)
        self._has_disk = has_disk
        self._take = take  # the table's: a block's host bytes into RAM, as room allows
        self._forget = forget
        self._demoting: dict[bytes, DeviceBlock] = {}  # evicted copies whose host copy is being made
        self._demoting_bytes = 0  # (bounded by the budget: past it, an evicted copy is dropped, not copied back)

    @property
    def budget(self) -> int:
        return self._tier.budget

    def stats(self) -> dict:
        return dict(device_bytes=self._tier.nbytes, device_blocks=len(self._tier), device_budget=self._tier.budget)

    # ------------------------------------------------ the table's own steps, under its lock

    def keys(self) -> tuple[bytes, ...]:
        return self._tier.keys()

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[DeviceBlock]]:
        """Each block's device copy (one on its way back to RAM included), else None."""
        got = self._tier.get_many(keys)
        if self._demoting:
            got = [d or self._demoting.get(k) for d, k in zip(got, keys)]
        return got

    def tokens(self, node: Node) -> Optional[np.ndarray]:
        block = self._tier.get(node.key) if node.on_device else None
        return None if block is None else block.tokens

    def keep(self, blocks: Sequence, pinned: Callable[[bytes], bool], leave_ram: Callable[[Node], None]
             ) -> list[DeviceBlock]:
        """Keep a hit's device copies as room allows (the blocks kept there leave RAM); returns the copies
        evicted to make room that go back to RAM."""
        evicted: list[DeviceBlock] = []
        for b in blocks:
            if b is not None and (node := self._index.get(b.key)) is not None and self._tier.add(b, pinned, evicted):
                node.on_device = True
                leave_ram(node)
        return self._back(evicted)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._tier.touch(keys)

    def dropped(self, key: bytes) -> None:
        """The table dropped the block."""
        self._tier.pop(key)
        if (d := self._demoting.pop(key, None)) is not None:
            self._demoting_bytes -= d.nbytes

    def _back(self, evicted: list[DeviceBlock]) -> list[DeviceBlock]:
        out = []
        for d in evicted:
            node = self._index.get(d.key)
            if node is None or not node.on_device:
                continue
            if node.in_ram or node.on_disk or (node.pending and self._has_disk):
                node.on_device = False
            elif self._demoting_bytes + d.nbytes > self._tier.budget:  # the writer far behind: GPU memory first
                node.on_device = False
                self._forget(node)
            else:
                self._demoting[d.key] = d
                self._demoting_bytes += d.nbytes
                out.append(d)
        return out

    # ------------------------------------------------------------------ what the store and the writer tell

    def trim(self, keep_bytes: int) -> list[DeviceBlock]:
        """Drop device copies, least recently used first, until at most ``keep_bytes`` are held; returns those
        to copy back to RAM (``demoted``)."""
        with self._lock:
            evicted: list[DeviceBlock] = []
            self._tier.shrink(keep_bytes, evicted)
            return self._back(evicted)

    def copy_back(self, blocks: list[DeviceBlock]) -> None:
        """The host copies of evicted device copies, made here (on the writer's thread: device work off the
        engine's), then ``demoted``."""
        for d in blocks:
            try:
                host = d.to_stored()
            except Exception:
                log.exception("kvstore: copying an evicted device block back to RAM failed; it is dropped")
                host = None
            self.demoted(d, host)

    def demoted(self, block: DeviceBlock, host: Optional[Stored]) -> None:
        """The host copy of an evicted device copy (None: it could not be made): into RAM as room allows,
        else the block leaves the index (evicted)."""
        with self._lock:
            if self._demoting.get(block.key) is not block:
                return  # dropped meanwhile
            del self._demoting[block.key]
            self._demoting_bytes -= block.nbytes
            node = self._index.get(block.key)
            if node is None or self._tier.get(block.key) is not None:
                return  # (kept on the device again meanwhile)
            node.on_device = False
            if host is not None and not node.in_ram:
                self._take(node, host)
            if not node.held:
                self._forget(node)

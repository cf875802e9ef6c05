"""What a remote tier holds, per model: the remote half of ``kvstore stats``
and ``kvstore clear``.

Read with SCAN (every primary of a cluster) and pipelined reads of each
block's model root and payload size; never the payloads themselves. Redis
evicts by its own policy, so the settings that decide what stays are
reported with the totals, with a warning when they would hurt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..tiers.remote.tier import RemoteTier

GOOD_POLICIES = ("allkeys-lru", "allkeys-lfu")


@dataclass
class RemoteCatalog:
    url: str
    cluster: bool
    blocks: list[tuple[bytes, str, bytes, int]]  # (key name, namespace tag, model root, payload bytes)
    models: dict[bytes, dict]
    servers: list[dict] = field(default_factory=list)  # INFO memory of each primary

    @classmethod
    def read(cls, tier: RemoteTier, namespace: Optional[str] = "*") -> "RemoteCatalog":
        return cls(tier.url.shown, tier.cluster, list(tier.scan(namespace)), tier.models(namespace),
                   tier.node_infos("memory"))

    def model_name(self, root: bytes) -> str:
        info = self.models.get(root, {})
        return info.get("name") or info.get("model_key") or root.hex()[:16]

    def select(self, model: Optional[str] = None) -> list[bytes]:
        """Key names of the blocks of models whose name or root key starts with ``model`` (all without)."""
        return [nm for nm, _, root, _ in self.blocks
                if model is None or self.model_name(root).startswith(model) or root.hex().startswith(model)]

    def roots(self, names: list[bytes]) -> list[bytes]:
        """Model roots of these blocks."""
        chosen = set(names)
        return sorted({root for nm, _, root, _ in self.blocks if nm in chosen})

    def summary(self) -> dict:
        models: dict[str, dict] = {}
        for _, ns, root, size in self.blocks:
            d = models.setdefault(self.model_name(root), {"blocks": 0, "bytes": 0, "namespaces": []})
            d["blocks"] += 1
            d["bytes"] += size
            if ns not in d["namespaces"]:
                d["namespaces"].append(ns)
        used = sum(int(s.get("used_memory", 0)) for s in self.servers)
        maxmem = sum(int(s.get("maxmemory", 0)) for s in self.servers)
        policies = sorted({str(s.get("maxmemory_policy", "?")) for s in self.servers})
        return {"url": self.url, "cluster": self.cluster, "primaries": len(self.servers), "blocks": len(self.blocks),
                "bytes": sum(b[3] for b in self.blocks), "used_memory": used, "maxmemory": maxmem,
                "maxmemory_policy": ",".join(policies), "models": models, "warnings": self.warnings(maxmem, policies)}

    @staticmethod
    def warnings(maxmem: int, policies: list[str]) -> list[str]:
        out = []
        if not maxmem:
            out.append("maxmemory is 0: the server grows until the machine runs out of memory; "
                       "set maxmemory (e.g. CONFIG SET maxmemory 8gb)")
        bad = [p for p in policies if p not in GOOD_POLICIES]
        if bad:
            out.append(f"maxmemory-policy {', '.join(bad)}: "
                       + ("writes fail when memory is full" if "noeviction" in bad else "only some keys can be evicted")
                       + "; use allkeys-lru (CONFIG SET maxmemory-policy allkeys-lru)")
        return out

"""StoreConfig: every setting of a store and every tuning constant, with
its reason, validated in one place.

``PrefixStore(budget_gb=4, ssd_path=...)`` builds one from its keywords;
``PrefixStore(config=StoreConfig(...))`` takes one whole (``replace`` it to
vary one field). The modules of the store read their constants from here;
tests and benchmarks vary them the same way.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Union

from .blocks.codec import ROTATE_AT_OR_BELOW, Codec
from .errors import ConfigError
from .gpu.backend import Backend, choose

GB = 1 << 30
DEFAULT_BLOCK = 256  # tokens per block of a new store
MAX_BLOCK = 1 << 16  # tokens per block: one block of an 8B model at fp16 is then 8 GiB, far past any use
POLICIES = ("auto", "always", "never")
ADMISSIONS = ("always", "reuse")  # ssd_admit

KvBits = Union[None, int, tuple[Optional[int], Optional[int]]]


_POSITIVE = ("write_batch_bytes", "write_ahead_bytes", "write_seconds", "max_pending_bytes", "writer_patience_s",
             "compress_rows", "full_pause_s", "evict_rounds", "remote_queue_bytes", "remote_batch_bytes", "remote_batch_blocks",
             "remote_close_wait", "remote_probe_blocks", "remote_read_bytes", "prior_ram_gbps",
             "prior_ssd_cached_gbps", "prior_ssd_cold_gbps", "unprobed_cold_gbps", "probe_bytes")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """The store's tuning knobs, each with the reason for its value: what a user
    rarely sets (``StoreConfig`` holds the settings a user chooses). Each is
    also accepted by name as a keyword of ``StoreConfig`` and ``PrefixStore``
    (``PrefixStore(write_batch_bytes=...)``), and read there as an attribute."""

    # Rotation before quantizing is the default at or below these bits: it measured better at 4 bits and not
    # at 8 (docs/benchmarks.md, fidelity).
    rotate_keys_at_or_below: Optional[int] = ROTATE_AT_OR_BELOW
    rotate_values_at_or_below: Optional[int] = ROTATE_AT_OR_BELOW
    # Bytes per disk write transaction: each commit idles the disk and the writer, so few large ones.
    write_batch_bytes: int = 512 << 20
    # Bytes encoded and not yet taken by the transaction being written (what the writer may run ahead by).
    write_ahead_bytes: int = 64 << 20
    # Seconds a write transaction stays open while blocks are encoded: it holds LMDB's write lock, which
    # other processes' writes wait for.
    write_seconds: float = 1.0
    # Bytes of queued puts past which a put is skipped whole (None: max(256 MiB, the RAM budget)); a queued put
    # counts the arrays it keeps alive until encoded, an engine's buffers passed with rows= whole.
    max_pending_bytes: Optional[int] = None
    # Seconds the writer waits at most, between two blocks, for an engine's fetch or put to end (``priority``).
    writer_patience_s: float = 0.05
    # Rows of a layer quantized at once, then cut into blocks (quantizing works row by row); on CUDA, rows of
    # consecutive blocks encoded and laid out together (``encode.encoded``: kernels per run, not per block).
    compress_rows: int = 2048
    # Seconds without disk writes after the device filled up and evicting could not help.
    full_pause_s: float = 30.0
    # Disk eviction: rounds of (pick victims, delete) per call, and the share of the budget it evicts to.
    evict_rounds: int = 64
    evict_to: float = 0.9
    # A disk block with this share of its pages in the page cache is planned as cached.
    cached_share: float = 0.9
    # Remote tier: copies waiting to be sent at most; bytes and blocks per pipelined write; seconds close()
    # gives the queue; blocks probed in one fetch; payload bytes per read round trip (the next one is queued
    # on the server as this one's replies arrive, so the first block comes in after one such round trip's
    # worth is made and sent: small ones let a hit start placing blocks sooner).
    remote_queue_bytes: int = 256 << 20
    remote_batch_bytes: int = 32 << 20
    remote_batch_blocks: int = 64
    remote_close_wait: float = 10.0
    remote_probe_blocks: int = 1024
    remote_read_bytes: int = 16 << 20
    # fetch_policy="auto" before a load rate is measured (``probe``): the prior of each state in GB/s
    # (None: probed at open, once per machine and store). The cold-SSD prior errs low: the probe reads the
    # file around the page cache (so it evicts nobody's pages), which runs below the store's own cold reads
    # through it (docs/benchmarks.md, hot path), and is counted in series with building the arrays (the
    # store overlaps them); ``prior_cold_share`` scales it further. Where the disk cannot be read around
    # the page cache it is ``unprobed_cold_gbps``, a SATA SSD's rate.
    prior_ram_gbps: Optional[float] = None
    prior_ssd_cached_gbps: Optional[float] = None
    prior_ssd_cold_gbps: Optional[float] = None
    prior_cold_share: float = 1.0
    unprobed_cold_gbps: float = 0.5
    # Bytes each memory probe moves (the cold-read probe reads 4x this, a few requests per thread): past the
    # latency of a disk request and a few caches' sizes, a few ms of memory bandwidth and tens of ms of disk,
    # once per machine and store.
    probe_bytes: int = 16 << 20
    # fetch_policy="auto" serves a hit only where it is predicted to save this share of recomputing: rates
    # and prefill model are estimates and a hit has costs they do not model (0: any predicted saving).
    serve_margin: float = 0.05

    def __post_init__(self):
        for f in fields(self):
            if f.name in _POSITIVE:
                v = getattr(self, f.name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                    raise ConfigError(f"{f.name} must be a number > 0, got {v!r}")
        for name in ("evict_to", "cached_share", "prior_cold_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        m = self.serve_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ConfigError(f"serve_margin must be in [0, 1), got {m!r}")


TUNING = frozenset(f.name for f in fields(Tuning))


@dataclass(frozen=True, kw_only=True, init=False)
class StoreConfig:
    """Every setting of a ``PrefixStore``, keyword-only and checked here.

    ``budget_gb`` bounds the RAM tier; with ``ssd_path`` every block is also
    written to an LMDB store there (write-through, in the background) that
    survives restarts and may be shared by several processes, bounded by
    ``disk_budget_gb`` (default: half the free space, at most 64 GiB);
    ``ssd_admit="reuse"`` writes there only blocks asked for again.
    ``kv_bits`` stores KV quantized (an int, or ``(key_bits, value_bits)``);
    ``None`` keeps the engine's dtype. ``rotate_keys`` rotates keys before
    quantizing them (``kvstore.blocks.rotation``; ``None``: at 4 bits or fewer),
    ``rotate_values`` values (``None``: at 4 bits or fewer too).
    ``full_attention_bits`` (as ``kv_bits``; ``"same"``: ``kv_bits``) keeps the
    full-attention layers of a model that also has sliding-window layers
    (Gemma 3's global ones) another way, e.g. ``None``: dense.
    Entries remember their own settings, so
    a store reopened with other settings reads old entries correctly.
    ``namespace`` salts every key: tenants never share or see blocks.
    ``fetch_policy``: ``"auto"`` serves the part of a hit that loads faster
    than the engine recomputes it (rates measured here, see ``cost``),
    ``"always"`` serves every stored token, ``"never"`` none.
    ``remote`` (``redis://[[user]:password@]host:port/db``, ``rediss://`` for
    TLS, ``unix:///path.sock``; the password may come from
    ``$KVSTORE_REMOTE_PASSWORD`` or ``$REDISCLI_AUTH``) adds a Redis / Valkey
    server or cluster shared by hosts, after RAM and LMDB: new blocks are
    copied there in the background, and a fetch reads there what the local
    tiers lack; a down server only costs ``remote_timeout`` seconds now and
    then. ``remote_secret`` (else ``$KVSTORE_REMOTE_SECRET``, which keeps it out
    of process lists) signs every block written there with a keyed MAC, and
    serves from there only blocks whose MAC checks out under it.
    ``tuning`` holds the knobs (``Tuning``, each with its reason); each may
    also be given here by its own name.
    """

    # ------------------------------------------------------------- settings
    budget_gb: float = 4.0  # the RAM tier's bytes
    # GPU memory for hot blocks' copies (CUDA; None: 1/16 of the GPU's memory, at most 8 GiB; 0: off). Where
    # memory is one (Apple silicon, CPUs) the RAM tier is the device tier and this is 0.
    device_budget_gb: Optional[float] = None
    ssd_path: Optional[Union[str, os.PathLike]] = None  # an LMDB store there (None: RAM only)
    disk_budget_gb: Optional[float] = None  # None: half the free space, at most 64 GiB
    # tokens per block; None: the store's own (recorded at its creation), DEFAULT_BLOCK for a new one. A store
    # reopened with another is served in its own, with a warning (its blocks' keys depend on it).
    block_size: Optional[int] = None
    kv_bits: KvBits = None  # an int, (key_bits, value_bits), or None: the engine's dtype
    kv_group_size: int = 64
    rotate_keys: Optional[bool] = None  # None: at 4 bits or fewer (``rotate_*_at_or_below``)
    rotate_values: Optional[bool] = None
    # Gemma 3-like models' full-attention layers: "same" as kv_bits, or bits of their own (None: dense); on
    # Gemma 3 270M q8 meets its targets with them dense (docs/benchmarks.md, Gemma 3 on the CPU)
    full_attention_bits: Union[KvBits, str] = "same"
    namespace: Optional[str] = None  # salts every key: tenants never share or see blocks
    readonly: bool = False
    fetch_policy: str = "auto"  # "auto", "always" or "never"
    # "always": every new block is written through to the SSD tier; "reuse": a block is written there only
    # once it is asked for again (a later put shares it, or a fetch serves it from RAM or the device), with
    # its prefix; until then it is in RAM only (one-off prompts cost no SSD writes, nor survive a restart)
    ssd_admit: str = "always"
    remote: Optional[str] = None  # redis://, rediss://, unix:// URL of a shared tier
    remote_timeout: float = 0.5  # seconds a down remote costs now and then
    # MAC key of remote blocks (None: $KVSTORE_REMOTE_SECRET, else none: blocks unsigned, any served);
    # never shown (repr=False)
    remote_secret: Optional[str] = field(default=None, repr=False)
    # Keep the cost model's estimates in the store per machine, and start from them at open (False: every
    # open starts knowing nothing, as a first request on a new machine does; benchmarks of that case).
    remember_rates: bool = True
    # fetch_policy="auto": seconds the first fetch of a model (``generate``) or its load (the servers) may spend
    # timing prefills of it before its first request, so a hit is weighed against what recomputing costs
    # (adapters/calibration.py). 0: none; hits are served until requests' own prefills have been timed.
    calibrate_budget_s: float = 3.0
    tuning: Tuning = Tuning()

    def __init__(self, **settings):
        """Keywords only: the settings, ``tuning``, and any of ``Tuning``'s knobs
        by name (applied on top of ``tuning``). ``TypeError`` for other names, as a
        dataclass gives (``store_config`` names the nearest ones instead)."""
        knobs = {k: settings.pop(k) for k in list(settings) if k in TUNING}
        tuning = settings.pop("tuning", Tuning())
        if knobs and isinstance(tuning, Tuning):
            tuning = replace(tuning, **knobs)
        for f in fields(self):
            if f.name == "tuning":
                value = tuning
            elif f.name in settings:
                value = settings.pop(f.name)
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        if settings:
            raise TypeError(f"StoreConfig() got unexpected keyword arguments {sorted(settings)}")
        self.__post_init__()

    def __getattr__(self, name: str):
        """A tuning knob read by its name (``config.write_batch_bytes``), as before knobs were nested."""
        if name in TUNING and "tuning" in self.__dict__:
            return getattr(self.tuning, name)
        raise AttributeError(f"'StoreConfig' object has no attribute {name!r}")

    def __post_init__(self):
        """Each setting checked, in this order: ``ConfigError`` names the first out of range."""
        self._check_layout()
        gib(self.budget_gb, "budget_gb")
        for name in ("device_budget_gb", "disk_budget_gb"):
            if getattr(self, name) is not None:
                gib(getattr(self, name), name)
        self._check_choices()
        self._check_remote()
        if not isinstance(self.tuning, Tuning):
            raise ConfigError(f"tuning must be a kvstore.config.Tuning, got {self.tuning!r}")

    def _check_layout(self) -> None:
        """What the store is and where: block size, namespace, the flags, the SSD path."""
        bs = self.block_size
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= MAX_BLOCK):
            raise ConfigError(f"block_size must be an int in [1, {MAX_BLOCK}] (tokens per block) or None, "
                              f"got {bs!r}")
        if self.namespace is not None and not isinstance(self.namespace, str):  # ("" is a namespace of its own)
            raise ConfigError(f"namespace must be a str or None, got {self.namespace!r}")
        for name in ("readonly", "remember_rates"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        p = self.ssd_path
        if p is not None and (not isinstance(p, (str, os.PathLike)) or not str(p).strip()):
            # "" would be the working directory: a store is made only where it is named
            raise ConfigError(f"ssd_path must name a directory (or be None for a RAM-only store), got {p!r}")

    def _check_choices(self) -> None:
        """The policies: fetch, SSD admission, calibration's budget."""
        check_policy(self.fetch_policy)
        if self.ssd_admit not in ADMISSIONS:
            raise ConfigError(f"ssd_admit must be one of {ADMISSIONS}, got {self.ssd_admit!r}")
        c = self.calibrate_budget_s
        if not _finite(c) or c < 0:
            raise ConfigError(f"calibrate_budget_s must be a number of seconds >= 0 (0: no calibration), got {c!r}")

    def _check_remote(self) -> None:
        """The remote tier's secret and timeout (its URL is checked where it is parsed)."""
        if self.remote_secret is not None and (not isinstance(self.remote_secret, str) or not self.remote_secret):
            raise ConfigError("remote_secret must be a non-empty str or None (None: $KVSTORE_REMOTE_SECRET, "
                              f"else none), got a {type(self.remote_secret).__name__}")
        t = self.remote_timeout
        if not _finite(t) or t <= 0:
            raise ConfigError(f"remote_timeout must be a number of seconds > 0, got {t!r}")

    @property
    def ram_bytes(self) -> int:
        return int(self.budget_gb * GB)

    def device_bytes(self, backend: Optional[Backend] = None) -> int:
        """The device tier's budget on ``backend`` (default: this machine's; 0
        where memory is one: the RAM tier is the device tier there)."""
        backend = backend or choose()
        if not backend.apart:
            return 0
        if self.device_budget_gb is not None:
            return int(self.device_budget_gb * GB)
        return min(8 * GB, backend.device_memory() // 16)

    @property
    def disk_bytes(self) -> Optional[int]:
        return None if self.disk_budget_gb is None else int(self.disk_budget_gb * GB)

    def pending_bound(self) -> int:
        return self.tuning.max_pending_bytes if self.tuning.max_pending_bytes is not None else max(256 << 20, self.ram_bytes)



def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"fetch_policy must be one of {POLICIES}, got {policy!r}")


def gib(gb: float, name: str) -> int:
    """``gb`` GiB in bytes; ``ConfigError`` unless a finite number >= 0."""
    if not _finite(gb) or gb < 0:
        raise ConfigError(f"{name} must be a finite number of GiB >= 0, got {gb!r}")
    return int(gb * GB)


def _finite(x) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def store_config(config: Optional[StoreConfig] = None, **settings) -> StoreConfig:
    """``config`` varied by ``settings`` (or ``StoreConfig(**settings)``), each
    checked as ``PrefixStore`` checks it, nothing opened: ``ConfigError``
    names a setting out of range, or one that does not exist and the nearest
    that do."""
    if config is not None and not isinstance(config, StoreConfig):  # e.g. PrefixStore("/path/to/store")
        raise ConfigError(f"PrefixStore: the one positional argument is a StoreConfig, not {config!r}; "
                          "settings are keywords (ssd_path=..., budget_gb=...)")
    names = [f.name for f in fields(StoreConfig)] + sorted(TUNING)
    for key in settings:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
            raise ConfigError(f"PrefixStore: no setting {key!r}" + (f"; did you mean {' or '.join(near)}?"
                                                                    if near else "")
                              + " (the settings are kvstore.config.StoreConfig's fields)")
    cfg = StoreConfig(**settings) if config is None else replace(config, **settings)
    Codec.of(cfg)  # the bits, group size and rotation settings
    return cfg


def init_signature() -> inspect.Signature:
    """``PrefixStore(config=None, *, <StoreConfig's fields>, <Tuning's fields>)``: what ``help()`` and editors show of the
    keywords ``__init__`` takes as ``**settings``."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation=Optional[StoreConfig])]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in (*fields(StoreConfig), *fields(Tuning))]
    return inspect.Signature(params)

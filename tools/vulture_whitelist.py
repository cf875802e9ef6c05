"""Names `vulture kvstore adapters tools --min-confidence 60` cannot see used,
each with who uses it. Vulture reads this file with the rest (it lies in
tools/); nothing imports it, and it is not meant to run.

Anything vulture lists that is not here is dead code: delete it, or add it
here with its user.
"""
# ruff: noqa
# fmt: off
_ = object  # (a stand-in: every line below only names an attribute)

# --- public API of kvstore (README, docs/, the adapters' users)
_.skipped_tokens  # Hit: stored tokens not served (recompute predicted faster); read by users and tools
_.skip_reason     # Hit: why they were not served
_.predicted_s     # Hit: the cost model's load estimate
_.set_budget      # PrefixStore.set_budget: the RAM budget changed at run time (public API; docs/errors.md)
_.trim_device     # PrefixStore.trim_device: GPU memory handed back to an engine that needs it (docs/architecture.md)
_.serialize       # kvstore.blocks.wire.serialize: a block's bytes (tests, tools/bench, users checking the format)
_.total_s         # adapters.generate's result: request time, reported by tools and users
_.Tier            # kvstore.tiers.base.Tier: the protocol every tier keeps (tests/test_tiers.py checks each); a new tier implements it
_.serve_in_thread  # adapters.server.Server: the server on a thread of an embedding process (tests/test_server_requests.py)
_.set_max_workers  # kvstore.convert.spread: fetch on fewer threads, for A/B runs (tests/test_spread.py)

# --- hooks a framework or the interpreter calls
_._close_all      # atexit: flushes the stores still open at interpreter exit
_.exc             # __exit__(*exc): the context-manager protocol
_.signum, _.frame  # signal handlers' signature (kvstore serve, kvstore vllm-mlx serve)
_.demo            # typer: `kvstore demo` (a registered command)
_.export_, _.import_  # typer: `kvstore export` / `kvstore import` (registered commands)
_._options        # typer: the app callback behind `kvstore --version`
_.__signature__   # inspect: PrefixStore's settings as keywords, for help() and editors
_.writeable       # numpy: arr.flags.writeable = False freezes checked bytes
_.pre_tokenizer, _.normalizer, _.post_processor  # tokenizers: a Tokenizer's pipeline, set by assignment
_._idx            # mlx-lm: RotatingKVCache's write position, set when the adapter builds one

# --- mlx-lm's LRUPromptCache interface (adapters/server_cache.py; mlx_lm.server calls these)
_.trim_to, _.n_sequences, _.stats_by_type, _.cache_type

# --- vllm-mlx's MemoryAwarePrefixCache / trie interface (adapters/vllm_mlx_cache.py; vllm-mlx's scheduler and
#     SimpleEngine call or read these; check_vllm_mlx() checks they are the ones vllm-mlx uses)
_._last_matched_key, _._last_match_type, _.evict_prefixes, _.include_ssd, _._entries, _._current_memory
_.memory_usage_mb, _.save_to_disk, _.load_from_disk, _.cache_dir, _.set_ssd_tier, _.check_ssd
_.try_reserve_memory, _.release_reserved_memory, _._trie

# --- oMLX's BlockAwarePrefixCache interface (adapters/omlx.py; oMLX's scheduler calls these by keyword or
#     position; check_omlx() checks they are the ones it uses)
_.extra_key_token_start, _.model_cache_config, _.boundary_snapshots, _.reconstruct_cache, _.clear_request_entry
_.set_paged_ssd_cache_manager, _.manager, _.set_cold_restore_callback, _.get_stats_dict, _.paged_cache_manager

# --- PrefixStore's inspection points (kvstore/inspection.py): public, for operators and tests
_.ram_keys, _.device_keys, _.held_bytes, _.pause_writer, _.engine_call

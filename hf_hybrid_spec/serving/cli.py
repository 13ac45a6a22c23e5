"""`hf-hybrid-spec-serve`: the OpenAI-compatible server (`serving.server`) of one engine in this process, or with
`--replicas N` of N replicas on Ray Serve behind one endpoint (`serving.cluster`, the `[cluster]` extra).

    hf-hybrid-spec-serve --model Qwen/Qwen3.5-0.8B --assistant-config '{"drafter": "suffix"}' --port 8000
    hf-hybrid-spec-serve --model Qwen/Qwen3.5-0.8B --replicas 4      # one replica per GPU
    python -m hf_hybrid_spec.serving.cli --help
"""

from __future__ import annotations

import json

from .server import DEFAULT_MAX_BODY_BYTES, create_app, load_served

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """`hf-hybrid-spec-serve`: load a model and serve it (see the module docstring); with `--replicas N`, N replicas
    on Ray Serve behind one endpoint (`serving.cluster`)."""
    from ..cli import argument_parser
    from .engine import ServingConfig

    parser = argument_parser("OpenAI-compatible server with speculative continuous batching for hybrid models "
                             "(hf_hybrid_spec)")
    parser.add_argument("--model", required=True, help="a Hub id or a local checkpoint")
    parser.add_argument("--assistant-config", default=None,
                        help="an AssistantConfig: a JSON object, or a folder / Hub id with assistant_config.json")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-slots", type=int, default=ServingConfig.max_slots, help="requests decoded at once")
    parser.add_argument("--max-total-tokens", type=int, default=ServingConfig.max_total_tokens,
                        help="the longest request (prompt and new tokens)")
    parser.add_argument("--prefix-cache-mb", type=int, default=ServingConfig.prefix_cache_bytes >> 20,
                        help="the bound on prefix-reuse states (0: off)")
    parser.add_argument("--lanes", type=int, default=ServingConfig.lanes,
                        help="engines the slots are split between, stepped in turn (ServingConfig.lanes)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    parser.add_argument("--device", default="auto", help="'auto': cuda where a GPU is seen, else cpu")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--draft-model", default=None,
                        help="the draft model of drafter 'model', 'eagle' or 'hvd': a causal LM (same tokenizer) or "
                             "an EAGLE-3 drafter folder / Hub id")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="the largest request body taken (larger: 413)")
    parser.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                        help="sampling settings a request omits: the model generation config's (auto), or OpenAI's "
                             "defaults (vllm, as vLLM names it)")
    cluster = parser.add_argument_group("cluster (Ray Serve, the [cluster] extra; see docs/serving.md)")
    cluster.add_argument("--replicas", type=int, default=None,
                         help="serve N replicas on Ray Serve behind this endpoint (default: one engine in this "
                              "process, no Ray)")
    cluster.add_argument("--routing", default="affinity", choices=["affinity", "round_robin", "power_of_two"],
                         help="how requests pick a replica: the one holding their prefix or session, else the least "
                              "loaded (affinity); in turn; or Ray Serve's default")
    cluster.add_argument("--replica-gpus", type=float, default=None,
                         help="GPUs per replica (default: 1 where the Ray cluster has GPUs, else 0)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0, help="CPU cores per replica")
    cluster.add_argument("--ray-address", default=None,
                         help="the Ray cluster to join (default: RAY_ADDRESS, else a local instance)")
    args = parser.parse_args(argv)
    serving = ServingConfig(max_slots=args.max_slots, max_total_tokens=args.max_total_tokens,
                            prefix_cache_bytes=args.prefix_cache_mb << 20, lanes=args.lanes)
    name = args.served_model_name or args.model
    if args.replicas is not None:
        from .cluster import serve_cluster

        if args.replicas < 1:
            parser.error(f"--replicas must be >= 1, got {args.replicas}")
        try:
            serve_cluster(args.model, args.assistant_config, serving, replicas=args.replicas, routing=args.routing,
                          host=args.host, port=args.port, served_model_name=name, api_key=args.api_key,
                          max_body_bytes=int(args.max_body_mb * 2**20), dtype=args.dtype, device=args.device,
                          draft_model=args.draft_model, replica_gpus=args.replica_gpus,
                          replica_cpus=args.replica_cpus, address=args.ray_address, blocking=True,
                          model_defaults=args.generation_config == "auto")
        except (ImportError, OSError, ValueError) as err:
            parser.error(f"{type(err).__name__}: {err}")
        return

    import uvicorn

    from .manager import ContinuousBatchingManager

    try:  # what the command line names is checked before the server starts: a clear error, not a traceback
        model, tokenizer, draft, config = load_served(args.model, args.assistant_config, args.dtype, args.device,
                                                      args.draft_model)
        manager = ContinuousBatchingManager(model, config, serving, draft_model=draft)
    except (OSError, ValueError, NotImplementedError, TypeError, json.JSONDecodeError) as err:
        parser.error(f"{type(err).__name__}: {err}")
    app = create_app(manager, tokenizer, name, api_key=args.api_key, max_body_bytes=int(args.max_body_mb * 2**20),
                     model_defaults=args.generation_config == "auto")
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()

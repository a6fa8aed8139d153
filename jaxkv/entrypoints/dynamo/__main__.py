"""``python -m jaxkv.entrypoints.dynamo [Dynamo runtime flags] [jaxkv engine flags]``: one
Dynamo worker over one jaxkv engine (``--help`` lists both). With the multi-host launch flags,
process 0 is the worker and the others follow its engine without Dynamo's runtime
(jaxkv/engine/multihost.py)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from jaxkv.entrypoints.dynamo import args
    from jaxkv.entrypoints.dynamo.engine import JaxkvEngine
    from dynamo.common.backend.run import run

    parsed = args.parse(argv)
    if parsed.launch is not None:
        from jaxkv.engine import multihost

        if not multihost.launch(parsed.engine, **parsed.launch):
            return      # a follower, stopped by the worker's shutdown
    run(JaxkvEngine, argv)


if __name__ == "__main__":
    main()

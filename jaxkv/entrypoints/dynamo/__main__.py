"""``python -m jaxkv.entrypoints.dynamo [Dynamo runtime flags] [jaxkv engine flags]``: one
Dynamo worker over one jaxkv engine (``--help`` lists both)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from jaxkv.entrypoints.dynamo.engine import JaxkvEngine
    from dynamo.common.backend.run import run

    run(JaxkvEngine, argv)


if __name__ == "__main__":
    main()

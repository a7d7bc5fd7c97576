"""``python -m shardline.controller``: run the operator (kopf) over every namespace, or ``--namespace NS`` ones."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardline.controller",
                                     description="Shardline's operator: serves every ShardlineModel.")
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="Watch only this namespace (repeat for more); default: all namespaces.")
    parser.add_argument("--standalone", action="store_true",
                        help="No peering with other operator instances (one replica, or a test).")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="Serve kopf's liveness probe here, e.g. http://0.0.0.0:8090/healthz.")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("--verbose", "-v", action="store_true",
                           help="Log at DEBUG too (each object applied); default: INFO and above.")
    verbosity.add_argument("--quiet", "-q", action="store_true", help="Log warnings and errors only.")
    args = parser.parse_args(argv)
    try:
        import kopf

        import shardline.controller.handlers  # noqa: F401  (registers the handlers)
    except ImportError as e:
        raise SystemExit(f"the operator needs {e.name}, which is not installed; install the kubernetes extra: "
                         "pip install 'shardline[kubernetes]'") from None

    # `kopf run` configures logging itself; kopf.run does not, and without it nothing is written (a refused
    # ShardlineModel included), so `kubectl logs deploy/shardline-controller` would show nothing.
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    kopf.run(namespaces=list(args.namespace), clusterwide=not args.namespace, standalone=args.standalone,
             liveness_endpoint=args.liveness)


if __name__ == "__main__":
    main()

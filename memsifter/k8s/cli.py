"""``memsifter k8s ...``: the plan for the chart, the pipeline driver, RayJob validation; chart generation
(repository tooling, memsifter_dev).

  memsifter k8s plan --config P.yaml       a pipeline config's plan as the chart's `pipeline` value
  memsifter k8s drive --plan plan.json     create the plan's RayJobs in the plan's order and wait
  memsifter k8s await-capacity ... -- CMD  request GPU nodes from the autoscaler, wait, exec CMD
  memsifter k8s await-published URI        wait until a stage output is published (the RayService's init container)
  memsifter k8s gen-chart [--check]        the chart's generated files from the stage registry (and sizes)
  memsifter k8s gen-jobs [--check]         jobs/<stage>.yaml rendered from the chart
  memsifter k8s validate FILE... [--crd F]  check RayJobs, RayServices, RayClusters (CRD schema strict, CEL,
                                           KubeRay admission rules; the packaged KubeRay v1.7.0 CRDs)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from ..console import setup_logging
from ..errors import MemsifterError

log = logging.getLogger(__name__)


def _gen(kind: str, argv: Sequence[str]) -> int:
    from . import registry

    try:
        from memsifter_dev.k8s import chart
    except ImportError:
        print(f"error: memsifter k8s gen-{kind} is repository tooling (memsifter_dev): run it in a checkout's "
              f"dev venv (scripts/setup.sh)", file=sys.stderr)
        return 2

    p = argparse.ArgumentParser(prog=f"memsifter k8s gen-{kind}")
    p.add_argument("--check", action="store_true", help="report drift instead of writing (exit 1 on drift)")
    args = p.parse_args(argv)
    infos = registry.stage_infos()
    problems = chart.check_images(infos) if kind == "chart" else []
    for prob in problems:
        print(f"error: {prob}", file=sys.stderr)
    out = chart.gen_chart(check=args.check, infos=infos) if kind == "chart" else \
        chart.gen_jobs(check=args.check, infos=infos)
    for line in out:
        print(line)
    if args.check and out:
        print(f"\n{len(out)} generated file(s) differ: run `memsifter k8s gen-{kind}`", file=sys.stderr)
        return 1
    if not out:
        print(f"gen-{kind}: up to date ({len(infos)} stages: {', '.join(i.name for i in infos)})")
    report, over = chart.size_report()
    print(report)
    for o in over:
        print(f"error: above target: {o}", file=sys.stderr)
    return 1 if problems or over else 0


def _validate(argv: Sequence[str]) -> int:
    import yaml

    from . import validate

    p = argparse.ArgumentParser(prog="memsifter k8s validate",
                                description="Check KubeRay manifests (RayJob, RayService, RayCluster) without an API "
                                            f"server, against the KubeRay {validate.KUBERAY_VERSION} CRDs shipped "
                                            "with memsifter")
    p.add_argument("files", nargs="+")
    p.add_argument("--crd", action="append", default=[],
                   help="a CRD YAML (.yaml or .yaml.gz) to use instead of the packaged one of its kind (repeatable)")
    args = p.parse_args(argv)
    schemas: dict[str, dict | None] = {}
    for path in args.crd:
        if not Path(path).is_file():
            print(f"error: --crd {path}: no such file", file=sys.stderr)
            return 2
        crd = validate.read_crd(path)
        kind = validate.crd_kind(crd)
        if kind not in validate.VALIDATORS:
            print(f"error: --crd {path}: a CRD of {kind}, not of {', '.join(validate.VALIDATORS)}", file=sys.stderr)
            return 2
        schemas[kind] = validate.crd_version_schema(crd, where=path)
    bad = seen = 0
    for f in args.files:
        for doc in yaml.safe_load_all(Path(f).read_text()):
            kind = doc.get("kind") if isinstance(doc, dict) else None
            if kind not in validate.VALIDATORS:
                continue
            if kind not in schemas:
                schemas[kind] = validate.kind_schema(kind)
            seen += 1
            errs = validate.validate_kuberay(doc, schemas)
            name = (doc.get("metadata") or {}).get("name")
            if errs:
                bad += 1
                print(f"{f}: {kind} {name}:\n  " + "\n  ".join(errs))
            else:
                print(f"{f}: {kind} {name}: ok")
    if not seen:
        print(f"error: no {', '.join(validate.VALIDATORS)} in {', '.join(args.files)}", file=sys.stderr)
        return 2
    return 1 if bad else 0


def _drive(argv: Sequence[str]) -> int:
    from .driver import Driver, KubernetesBackend, Plan, RayBackend

    p = argparse.ArgumentParser(prog="memsifter k8s drive", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="plan.json rendered by the chart (path or s3:// URI)")
    p.add_argument("--namespace", default=None, help="default: POD_NAMESPACE or the in-cluster namespace")
    p.add_argument("--poll", type=float, default=15.0, help="seconds between status checks")
    p.add_argument("--stage-timeout", type=float, default=0.0, help="fail a stage after this many seconds")
    p.add_argument("--ray-address", default=None,
                   help="run the plan's entrypoints on this Ray cluster (job API URL) instead of Kubernetes")
    p.add_argument("--no-manifest", action="store_true", help="do not write the run manifest")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    plan = Plan.load(args.plan)
    backend = (RayBackend(args.ray_address, pod_env=True, configs=plan.configs,
                          settings=plan.run.get("settings")) if args.ray_address
               else KubernetesBackend.from_environment(args.namespace))
    driver = Driver(plan, backend, poll=args.poll, stage_timeout=args.stage_timeout,
                    write_manifest=not args.no_manifest)
    manifest = driver.run()
    states = ", ".join(f"{k}: {v['state']}" for k, v in manifest["stages"].items())
    print(f"run {plan.run.get('id')}: {manifest['state']} ({states})")
    if not args.no_manifest:
        print(f"run manifest: {plan.manifest_uri}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"gen-chart": lambda a: _gen("chart", a), "gen-jobs": lambda a: _gen("jobs", a),
            "validate": _validate, "drive": _drive}
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "await-capacity":
        from . import capacity

        setup_logging(0)
        return capacity.main(rest)
    if cmd == "plan":
        from . import plan

        cmds["plan"] = plan.main
    if cmd == "await-published":
        from . import published

        setup_logging(0)
        return published.main(rest)
    if cmd not in cmds:
        print(f"memsifter k8s: unknown command '{cmd}'\n{__doc__}", file=sys.stderr)
        return 2
    try:
        return cmds[cmd](rest)
    except MemsifterError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code

"""`ninfer inspect FILE`: what an artifact holds, read from its header (tensor data is not touched)."""

from __future__ import annotations

import argparse
import collections
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .ninfer artifact")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def describe(art, list_tensors: bool = False) -> str:
    meta = art.metadata
    lines = [
        f"file          {art.path}",
        f"format        .ninfer v{art.header['version']}",
        f"name          {meta.get('name')}",
        f"architecture  {meta.get('architecture')}",
        f"source        {json.dumps(meta.get('source', {}), ensure_ascii=False)}",
        f"config        {json.dumps(art.config, ensure_ascii=False)}",
        f"chat template {'yes' if art.chat_template else 'none'}",
        f"special       {json.dumps({k: v for k, v in art.special_tokens.items() if k != 'tokens'})}"
        f" + {len(art.special_tokens.get('tokens', {}))} special token spellings",
        f"generation    {json.dumps(art.generation, ensure_ascii=False)}",
    ]
    infos = art.all_tensor_infos()
    count, size = collections.Counter(), collections.Counter()
    dtypes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for info in infos:
        count[info.component] += 1
        size[info.component] += info.nbytes
        dtypes[info.component][info.dtype] += 1
    lines.append(f"tensors       {len(infos)}, {_mb(sum(size.values()))}")
    lines.append("components")
    for comp in art.components:
        kinds = ", ".join(f"{d}×{n}" for d, n in sorted(dtypes[comp].items()))
        lines.append(f"  {comp:<14}{count[comp]:>6} tensors {_mb(size[comp]):>14}   ({kinds})")
    if list_tensors:
        lines.append("tensor index")
        for info in infos:
            lines.append(f"  {info.name:<40} {info.component:<8} {info.dtype:<5} "
                         f"{str(list(info.shape)):<20} @{info.offset} {info.nbytes} B")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact import ArtifactError, open_artifact

    try:
        art = open_artifact(args.file, components=None)
    except (ArtifactError, OSError) as exc:
        print(f"ninfer inspect: error: {exc}", file=sys.stderr)
        return 1
    with art:
        print(describe(art, args.tensors))
    return 0

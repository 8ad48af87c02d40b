"""The torch the course asks pip for is a torch its lessons import from.

Lesson 09 (and 08) import ``fully_shard``, ``MixedPrecisionPolicy`` and ``FSDPModule`` from
``torch.distributed.fsdp``, where they are public from torch 2.6 (before, FSDP2 lived in
``torch.distributed._composable.fsdp``): a cluster module or a container with torch 2.4 or 2.5
met ``pyproject.toml``'s bound and then failed on import.
"""

from __future__ import annotations

import ast
import re

from tests.lessons import REPO

# what each name of torch.distributed.fsdp needs: public there from torch 2.6
FSDP2_PUBLIC_FROM = {"fully_shard": (2, 6), "MixedPrecisionPolicy": (2, 6),
                     "FSDPModule": (2, 6), "CPUOffloadPolicy": (2, 6)}


def _lower_bound(package: str) -> tuple[int, int]:
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf'^\s*"{package}>=(\d+)\.(\d+)[^"]*",?\s*$', text, re.M)
    assert found, f"pyproject.toml has no {package}>=X.Y dependency"
    return int(found.group(1)), int(found.group(2))


def _fsdp_imports() -> dict[str, list[str]]:
    """Name imported from torch.distributed.fsdp -> the solution files that import it."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "solutions").glob("*/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed.fsdp":
                for alias in node.names:
                    names.setdefault(alias.name, []).append(str(path.relative_to(REPO)))
    return names


def test_pyproject_asks_for_the_torch_that_lesson_09_imports_from():
    used = _fsdp_imports()
    assert "fully_shard" in used, "no lesson imports fully_shard any more: update this test"
    bound = _lower_bound("torch")
    for name, files in used.items():
        needs = FSDP2_PUBLIC_FROM.get(name)
        if needs:
            assert bound >= needs, (
                f"pyproject.toml says torch>={bound[0]}.{bound[1]}, but {files[0]} imports "
                f"{name} from torch.distributed.fsdp, public only from torch "
                f"{needs[0]}.{needs[1]}: an older torch meets the bound and fails on import")


def test_torchvision_bound_is_the_one_built_for_that_torch():
    torch_major, torch_minor = _lower_bound("torch")
    assert torch_major == 2
    # torchvision 0.(minor + 15) is built against torch 2.minor (0.19: 2.4, 0.21: 2.6)
    assert _lower_bound("torchvision") >= (0, torch_minor + 15)

"""The error tree drawn in aiollama.errors' docstring stays complete and true."""

from __future__ import annotations

import inspect
import re

import aiollama
from aiollama import errors


def drawn_tree() -> list[tuple[int, str]]:
    """(depth, name) of each class in the docstring's tree, in order."""
    doc = errors.__doc__ or ""
    rows = []
    for line in doc.splitlines():
        match = re.match(r"^(\s*(?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+)\s", line + " ")
        if match and isinstance(getattr(errors, match.group(2), None), type):
            prefix = line[: line.index(match.group(2))]
            rows.append((len(prefix) // 4 - 1, match.group(2)))  # the docstring indents the root by 4
    return rows


def test_the_tree_lists_every_error_class_in_order() -> None:
    classes = [name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.AiollamaError)]
    assert [name for _, name in drawn_tree()] == classes


def test_the_tree_draws_each_class_under_its_parent() -> None:
    parents: list[str] = []
    for depth, name in drawn_tree():
        del parents[depth:]
        cls = getattr(errors, name)
        if parents:
            assert cls.__bases__[0] is getattr(errors, parents[-1]), f"{name} is drawn under {parents[-1]}"
        parents.append(name)


def test_every_error_is_exported() -> None:
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, errors.AiollamaError):
            assert getattr(aiollama, name) is obj


def test_load_errors_are_also_the_os_errors_open_raises() -> None:
    assert issubclass(errors.ModelNotFound, FileNotFoundError)
    assert issubclass(errors.ModelIsADirectory, IsADirectoryError)
    for cls in (errors.ModelNotFound, errors.ModelIsADirectory, errors.UnsupportedModel):
        assert issubclass(cls, errors.ModelLoadError)

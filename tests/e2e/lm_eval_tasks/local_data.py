"""`custom_dataset` of the tandem_* tasks: the JSONL files their YAML names in
`dataset_kwargs.data_files`, read from this directory (whatever the working directory), in
memory (nothing downloaded, no datasets cache)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_metadata):
    """{split: file} -> a DatasetDict; a relative file is looked up beside this module."""
    import datasets

    splits = {}
    for split, name in data_files.items():
        path = HERE / name
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)

"""README.md model card of a model folder: Hub metadata, how to load, the conversion report."""

from __future__ import annotations

from typing import Any

import yaml

PAPER = ("Copy the Same, Distill the Difference: Initializing Linear Vision Transformers")
VARIANT_PAPERS = {
    "elu": "Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)",
    "relu": "Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)",
    "inline": "Han et al. 2024, Bridging the Divide: Reconsidering Softmax and Linear Attention (NeurIPS)",
    "mhla": "Zhang et al. 2026, Restoring Expressivity of Linear Attention via Token-Level Multi-Head (ICLR)",
    "ttt": "Linearizing Vision Transformers with Test-Time Training (ICML 2026)",
}


def card_metadata(config: dict[str, Any]) -> dict[str, Any]:
    block = config.get("vitconvert", {})
    pre = config.get("pretrained_cfg", {})
    meta: dict[str, Any] = {
        "library_name": "timm",
        "tags": ["vitconvert", "linear-attention", block.get("variant", "?"), "image-classification"],
        "pipeline_tag": "image-classification",
    }
    source = block.get("source")
    if source and source.startswith("hf-hub:"):
        meta["base_model"] = source.removeprefix("hf-hub:").split("@")[0]
    elif pre.get("hf_hub_id"):
        meta["base_model"] = pre["hf_hub_id"]
    if pre.get("license"):
        meta["license"] = pre["license"]
    return meta


def report_table(block: dict[str, Any]) -> str:
    rows = ["| group | init | tensors | parameters |", "|---|---|---:|---:|"]
    for row in block.get("groups", []):
        rows.append(f"| {row['group']} | {row['action']} | {row['tensors']} | {row['params']:,} |")
    return "\n".join(rows)


def render_card(config: dict[str, Any]) -> str:
    block = config.get("vitconvert", {})
    variant = block.get("variant", "?")
    arch = config.get("architecture", "?")
    init = block.get("init", {})
    recipe = (f"Init recipe: attention `{init.get('attn')}`, MLP `{init.get('mlp')}`, rest `{init.get('rest')}`, "
              f"seed {init.get('seed')}.")
    notes = "".join(f"- {n}\n" for n in block.get("notes", [])) or "- none\n"
    return f"""---
{yaml.safe_dump(card_metadata(config), sort_keys=False).strip()}
---
# {arch} with {variant} linear attention

A `{arch}` whose softmax attention was replaced by **{variant}** linear attention (cost O(N) in the number
of tokens) by [vitconvert](https://github.com/vitconvert/vitconvert), following *{PAPER}*: MLPs and the rest
copied from the softmax source, attention initialised by the `{init.get('attn', '?')}` recipe.

Source: `{block.get('source') or 'a timm model'}`.

## Use

```python
import vitconvert
model = vitconvert.load("path/or/hf-hub:org/name")
```

## Conversion report

{recipe}

{report_table(block)}

Notes:
{notes}
## Citation

- {PAPER}
- {VARIANT_PAPERS.get(variant, variant)}
"""

r"""A Hugging Face model family as a module: how its models become an equation and back.

A family is a subclass of [`AbstractHFFamily`][itde.interop.AbstractHFFamily] in its own
file (`_hf_<family>.py`) plus one entry per model class in `itde.interop.HF_FAMILIES`;
`from_hf` and `to_hf` only look the class up and call the family's methods.

**No silent routing.** A family converts the model classes it lists in `classes` and
nothing else: a Gemma model handed to the Llama converter fails with the class named.

**No ignored field that changes the network.** A config field whose value is set is one of
three kinds, decided from the installed `transformers` itself
(`transformers_fields`):

- known to the family (`fields`: the fields its converter reads, refuses by value, or knows
  to leave the hidden states unchanged) or to every family (`_BASE_FIELDS`: names, labels,
  output switches): converted, or refused by the family's own checks with the reason;
- *semantic*: the model's config class defines it (a dataclass field, a parameter of its
  `__init__`, an `attribute_map` name), or the transformers code that runs the model reads
  it (`config.<name>`, `getattr(config, "<name>")` in the modules of the model class, of the
  classes it inherits from, and of every transformers module those import from): it may
  change what the model computes, so a family that does not know it refuses it by name
  (a Llama config carrying Mistral's `sliding_window`, which transformers' cache and masks
  read);
- *metadata*: neither defined nor read (`_model_name_or_path`, `unk_token_id`,
  `is_llama_config`, `transformers.js_config`, which hub configs carry): transformers keeps
  it on the config and never looks at it, so it cannot change the network, and is accepted.

The scan reads the installed sources once per model class (cached): a field a later
transformers starts reading is refused without a change here. A textual read is an
over-approximation (a docstring's `config.x` counts too), which errs on refusing. Where a
source cannot be read (a compiled or stripped install), a set field the family does not
know and the config class does not define is undecided, and refused with why: never taken
for metadata. A config whose set fields the family all knows needs no scan.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import inspect
import json
import re
import sys
import types
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx

if TYPE_CHECKING:
    from ._hf_model import HFTransformer

# Fields of every `PretrainedConfig` (names, labels, output switches): none changes the
# hidden states.
_BASE_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "is_encoder_decoder", "label2id", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "_attn_implementation_autoset", "use_return_dict", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "tf_legacy_loss", "torchscript", "pruned_heads", "decoder_start_token_id",
    "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "gradient_checkpointing", "layer_norm_eps_is_set", "_commit_hash",
})  # fmt: skip

# Values of an unknown field that switch nothing on.
_OFF = (None, False)


class AbstractHFFamily(eqx.Module):
    """How the models of one Hugging Face family become an equation, and back.

    A subclass declares `classes` (the `transformers` model classes it converts exactly)
    and `fields` (every config field its converter reads, refuses by value, or knows to
    leave the hidden states unchanged), and implements `convert` and `write`.
    """

    classes: ClassVar[tuple[str, ...]]
    fields: ClassVar[frozenset[str]]

    @abc.abstractmethod
    def convert(self, model: Any, name: str) -> HFTransformer:
        """The equation of `model` (an instance of the class `name`, one of `classes`)."""

    @abc.abstractmethod
    def write(self, m: HFTransformer, model: Any) -> None:
        """Write the weights of `m` into `model`, a freshly built module of `m`'s class and
        config (the inverse of `convert`)."""

    def build_kwargs(self, name: str, m: Any = None) -> dict:
        """Keyword arguments of the model class's constructor besides the config, for
        `to_hf` of the converted model `m`."""
        return {}

    def window(self, config: Any) -> Any:
        """The sliding window (`itde.SlidingWindow`) a model of this config attends within,
        or None (full attention); `to_hf` refuses a model whose window is not this."""
        return None

    def float64_patches(self) -> tuple[tuple[Any, str, Any], ...]:
        """`(owner, attribute, replacement)` triples that make this family's Hugging Face
        code compute in the model's dtype where it computes in float32 (RMSNorm, rotary
        angles), for [`hf_float64`][itde.interop.hf_float64]. Softmax is patched once for
        every family."""
        return ()

    def check(self, model: Any, name: str) -> None:
        """Refuse a model class, packed weights, or a config field this family does not
        convert."""
        self.check_class(name)
        check_weights(model)
        self.check_fields(model, name)

    def check_class(self, name: str) -> None:
        """Refuse a model class this family does not list."""
        if name not in self.classes:
            raise TypeError(
                f"`model` is a {name}, which {type(self).__name__} does not convert (it "
                f"converts {', '.join(self.classes)}): another family's forward is not this "
                "one's even where their configs look alike."
            )

    def check_fields(self, model: Any, name: str) -> None:
        """Refuse a set config field of `model` (of class `name`) that may change what it
        computes (see `transformers_fields`)
        and that this family does not know (`fields`)."""
        family = type(self).__name__
        set_fields = sorted(
            (k, v)
            for k, v in config_fields(model.config).items()
            if k not in _BASE_FIELDS and k not in self.fields
            and k != "quantization_config" and not _off(k, v)
        )  # fmt: skip
        if not set_fields:
            return  # nothing to decide
        unreadable = None
        try:
            semantic = transformers_fields(type(model), type(model.config))
        except SourceUnreadable as e:  # fail closed: what the config defines is still known
            semantic, unreadable = _config_defines(type(model.config)), e
        unknown = [(k, v) for k, v in set_fields if k in semantic]
        if unknown:
            k, v = unknown[0]
            raise ValueError(
                f"`config.{k}`={v!r} is not a field {family} converts: {semantic[k]}, so it "
                f"may change what {name} computes, and the converted model would ignore "
                f"it{_more(unknown)}. Remove it (or set it to None) if the model does not "
                f"use it; {family} reads {', '.join(sorted(self.fields))}.{_converted_by(k)}"
            )
        if unreadable is not None:
            k, v = set_fields[0]
            raise ValueError(
                f"`config.{k}`={v!r} is not a field {family} converts, and whether "
                f"transformers reads it cannot be decided: {unreadable}. A field transformers "
                f"reads may change what {name} computes (a Llama's `sliding_window` makes its "
                f"masks windowed), so it is refused rather than ignored{_more(set_fields)}. "
                "Install transformers with its Python sources, or remove the field (or set it "
                "to None) if the model does not use it."
            ) from unreadable


def config_fields(config) -> dict:
    return config.to_dict()


def config_json(config) -> str:
    """A model's config as JSON (kept by the converted model, for `to_hf`)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


# Fields whose False switches something off that is on by default: `is_causal=False` makes
# Hugging Face's `create_causal_mask` bidirectional.
_ON_BY_DEFAULT = frozenset({"is_causal"})


def _off(key: str, v) -> bool:
    if key in _ON_BY_DEFAULT:
        return v is None or v is True
    return any(v is o for o in _OFF) or v == {} or v == []


# A read of a config field in transformers' source: `config.<name>` (also `self.config.x`,
# `model.config.x`) or `getattr(config, "<name>"` / `hasattr(...)`.
_READ = re.compile(
    r"""\bconfig\.([A-Za-z_]\w*)"""
    r"""|\b(?:getattr|hasattr)\(\s*[\w.]*config\s*,\s*["']([A-Za-z_]\w*)["']"""
)


class SourceUnreadable(RuntimeError):
    """The source of a transformers module the rule must read cannot be read (a compiled or
    stripped install): which config fields its code reads cannot be derived."""


@functools.cache
def _reads(module_name: str) -> frozenset[str]:
    """The config fields the source of the module `module_name` reads; raises
    `SourceUnreadable` when that source cannot be read (never "nothing read": a field the
    module reads would then pass as metadata)."""
    try:
        source = inspect.getsource(importlib.import_module(module_name))
    except (OSError, TypeError, ImportError) as e:
        raise SourceUnreadable(
            f"the source of `{module_name}` cannot be read ({type(e).__name__}: {e})"
        ) from e
    return frozenset(a or b for a, b in _READ.findall(source))


def _imported(module: types.ModuleType) -> set[str]:
    """`module` and the transformers modules it imports from (its functions, classes and
    modules' own modules)."""
    found = {module.__name__}
    for value in vars(module).values():
        if isinstance(value, types.ModuleType):
            owner = value.__name__
        else:
            owner = getattr(value, "__module__", None)
        if isinstance(owner, str) and owner.split(".")[0] == "transformers":
            found.add(owner)
    return found


@functools.cache
def transformers_fields(model_cls: type, config_cls: type) -> dict[str, str]:
    """The config fields that may change what a `model_cls` computes, each with why: those
    its config class `config_cls` defines (dataclass fields, `__init__` parameters,
    `attribute_map` names, along its MRO), and those the transformers code running it reads
    (the modules of `model_cls` and of its transformers base classes, and every transformers
    module those import from). Any other field of a config is metadata (see the module's
    docstring). Computed once per pair of classes; raises `SourceUnreadable` when a source
    cannot be read."""
    why: dict[str, str] = {}
    own = sys.modules[model_cls.__module__]
    near = _imported(own)  # the model's module and what it imports: named first
    modules = set(near)
    for cls in model_cls.__mro__:
        if cls.__module__.split(".")[0] == "transformers":
            modules |= _imported(sys.modules[cls.__module__])
    order = sorted(modules, key=lambda m: (m != own.__name__, m not in near, m))
    where: dict[str, list[str]] = {}
    for module in order:
        for field in _reads(module):
            where.setdefault(field, []).append(module.removeprefix("transformers."))
    for field, mods in where.items():
        shown = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        why[field] = f"transformers reads it ({shown})"
    return why | _config_defines(config_cls)


@functools.cache
def _config_defines(config_cls: type) -> dict[str, str]:
    """The fields the config class `config_cls` defines (dataclass fields, `__init__`
    parameters, `attribute_map` names, along its MRO), each with why: known without any
    source."""
    why: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):
        if cls is object:
            continue
        defined: set[str] = set()
        if dataclasses.is_dataclass(cls):
            defined |= {f.name for f in dataclasses.fields(cls)}
        init = vars(cls).get("__init__")
        if init is not None:
            try:
                params = inspect.signature(init).parameters.values()
            except (TypeError, ValueError):  # pragma: no cover - a builtin __init__
                params = ()
            defined |= {
                p.name for p in params
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
            }  # fmt: skip
        for k, v in (vars(cls).get("attribute_map") or {}).items():
            defined |= {k, v}
        for field in defined:
            why[field] = f"{config_cls.__name__} defines it"
    return why


def check_weights(model) -> None:
    """Refuse a model whose parameters are not all float16, bfloat16, float32 or float64
    (quantized weights kept packed, e.g. by a GGUF, bitsandbytes or FP8 loader, whose forward
    unpacks or rescales them): the converter reads every weight as the matrix it multiplies
    by. A model whose quantized checkpoint was dequantized on loading (transformers' GGUF
    loader for Llama) holds plain weights and converts; its `config.quantization_config`
    says how the file stored them, not what the model computes."""
    import torch

    plain = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for pname, p in getattr(model, "named_parameters", lambda: ())():
        if p.dtype not in plain:
            quant = getattr(getattr(model, "config", None), "quantization_config", None)
            raise ValueError(
                f"`model`'s parameter `{pname}` is {p.dtype}, a quantized weight kept packed "
                f"(`config.quantization_config`={quant!r}); itde converts floating-point "
                "weights: load the model with its weights dequantized."
            )


#: The Hugging Face model classes `from_hf` converts, by class name, and their families.
HF_FAMILIES: dict[str, AbstractHFFamily] = {}
"""The Hugging Face model classes `from_hf` converts, by class name, and their families
(instances of `AbstractHFFamily`; filled by `itde.interop._hf`, which imports them all)."""


def _converted_by(field: str) -> str:
    """The families that convert `field` (the nearest supported ones for a model that sets
    it), as a sentence; empty when none does."""
    families = {getattr(f, "base_family", f) for f in HF_FAMILIES.values()}  # heads: their base
    names = sorted({type(f).__name__ for f in families if field in f.fields})
    if not names:
        return ""
    return f" The families that convert `{field}`: {', '.join(names)}."


def _more(unknown) -> str:
    if len(unknown) == 1:
        return ""
    return " (also " + ", ".join(f"`{k}`" for k, _ in unknown[1:]) + ")"

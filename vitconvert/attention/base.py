"""What every linear-attention variant shares.

A variant keeps the softmax module's projections under the same names (``qkv`` or ``q_proj``/``k_proj``/
``v_proj``, ``q_bias``/``v_bias``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``) and replaces only
the softmax mixing of tokens by its own O(N) ``mix``. Copying the projections keeps the call signature and
the state-dict names of timm's attention, so the surgery is a module swap and the init recipes can address
matched parameters by name.

The variants hold timm's model contract (tests/timm_contract): ``forward`` takes the named arguments timm's
blocks pass (no ``**kwargs``), options used in ``forward`` are typed attributes set at construction, and Python-only
paths (the slow references, ONNX and flash-linear-attention switches, autocast) sit behind
``torch.jit.is_scripting()`` branches, so ``torch.jit.script`` compiles every variant; FX treats
them as leaf modules (their grid dispatch depends on the token count), as timm does for its own such modules.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Optional

import torch
from timm.layers import register_notrace_module
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from torch import nn
from torch.nn import functional as F

from .ops.dispatch import use_fused_kernels
from .options import Option, describe, in_effect, read_options, with_defaults

# Children of timm's attention modules that have the same role in a linear variant.
MATCHED_MODULES = ("qkv", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "norm", "gate", "proj")
MATCHED_PARAMS = ("q_bias", "v_bias")
# Softmax-only machinery that a linear variant drops (logit biases have no linear analogue).
DROPPED = ("relative_position_bias_table", "rel_pos")

Grid = Optional[tuple[int, int]]


def key_validity(attn_mask: Optional[torch.Tensor], batch: int, tokens: int) -> Optional[torch.Tensor]:
    """(B, N) bool of keys a softmax query may attend to, from timm's additive or boolean mask.

    A linear attention has no logits to mask, so a padding mask becomes "drop these keys from the sums".
    """
    if attn_mask is None:
        return None
    mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    valid = mask.any(dim=-2).all(dim=1)  # over queries, then heads
    return valid.expand(batch, tokens)


class LinearAttention(nn.Module):
    """Base of every variant: softmax projections in, a linear token mixer in the middle.

    Built two ways, both leaving an initialised module: like timm's ``Attention`` (``dim, num_heads, qkv_bias,
    qk_norm, ...``; so a variant is a timm ``attn_layer``), or from a softmax module with :meth:`from_softmax`,
    which copies its projections. A variant's own options are declared once, in ``declared_options``
    (options.py): they are keyword arguments of its constructor, ``default_options`` lists their defaults and
    ``self.options`` holds their values as read (saved in config.json). A variant's constructor calls this one,
    then builds and initialises its own parameters, as timm's modules do: nothing here calls back into it.
    """

    variant: ClassVar[str] = ""  # its registry name (registry.register_variant)
    paper: ClassVar[str] = ""  # the paper it comes from, one line (model cards, `vitconvert list`)
    bibtex: ClassVar[str] = ""  # BibTeX of that paper (model cards)
    declared_options: ClassVar[tuple[Option, ...]] = ()  # the variant's options, each declared once
    default_options: ClassVar[dict[str, Any]] = {}  # {name: default} of declared_options (set per class)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.default_options = {o.name: o.default for o in cls.declared_options}
        if cls.declared_options and cls.__dict__.get("__doc__"):  # help(cls) lists the options
            cls.__doc__ = f"{cls.__doc__.rstrip()}\n\n{describe(cls.declared_options)}\n"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: Optional[int] = None,
        dim_out: Optional[int] = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: Optional[Callable[..., nn.Module]] = None,
        num_prefix_tokens: int = 1,
        grid_size: Grid = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        **options: Any,
    ):
        super().__init__()
        if attn_drop:
            raise ValueError(f"attn_drop={attn_drop}: linear attention forms no attention weights to drop "
                             "(use proj_drop)")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm and scale_norm need a norm_layer")
        dd = {"device": device, "dtype": dtype}
        head_dim = attn_head_dim or dim // num_heads
        if attn_head_dim is None and dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.options: dict[str, Any] = self.checked_options(options)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_heads  # grouped-query attention only by from_softmax
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim ** -0.5
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size: Grid = tuple(grid_size) if grid_size is not None else None  # type: ignore[assignment]
        self.rotate_half = False
        self.dropped: list[str] = []
        # The fast/literal choices, made once like timm's fused_attn: the Triton kernels where a call can take them;
        # the slow literal form of the formula (``reference``, eager only) when a test or a check sets it
        self.fused_kernels: bool = use_fused_kernels()
        self.use_reference: bool = False
        # timm's Attention layout, in MATCHED_MODULES order (state-dict order does not depend on the way in)
        self.qkv: Optional[nn.Linear] = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        for name in ("q_proj", "k_proj", "v_proj"):
            self.register_module(name, None)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        for name in MATCHED_PARAMS:
            self.register_parameter(name, None)
        self.register_buffer("k_bias", None, persistent=False)
        self.proj_drop = nn.Dropout(proj_drop)
        self.dim = self.proj.out_features

    def checked_options(self, given: dict[str, Any]) -> dict[str, Any]:
        """The constructor's options, read and checked by their declaration (a bad value is
        ``BadValue(option_name, ...)``, an undeclared name the TypeError of any unknown keyword argument)."""
        declared = {o.name: o for o in self.declared_options}
        for name in given:
            if name not in declared:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {name!r}")
        return {name: o.value(given[name], self.variant) if name in given else o.default
                for name, o in declared.items()}

    @property
    def building_on_meta(self) -> bool:
        """Built under ``torch.device("meta")`` or by :meth:`from_softmax`: values come later (``to_empty`` +
        :meth:`reset_extra_parameters`, or loaded weights), so the constructor skips drawing them."""
        return self.proj.weight.device.type == "meta"

    @classmethod
    def grid_problem(cls, options: dict[str, Any], grid_size: Grid,
                     given: frozenset[str] = frozenset()) -> Optional[str]:
        """Why the options the user set (``given``; ``options``: all, read and checked) fit no layer on a
        ``grid_size`` grid, or None. Asked at convert time: a folder rebuilt at another size keeps its options."""
        return None

    @classmethod
    def from_softmax(cls, module: nn.Module, num_prefix_tokens: int = 1, grid_size: Grid = None,
                     **options: Any) -> LinearAttention:
        """A variant with ``module``'s projections (copied); extra parameters get the method's default init.

        Built on the meta device with ``module``'s geometry, then given ``module``'s matched parts by name
        (copies), then materialised on ``module``'s device and the extras initialised, once."""
        options = read_options(cls.declared_options, options, cls.variant)
        in_proj = module.qkv if getattr(module, "qkv", None) is not None else module.q_proj
        weight = module.proj.weight
        head_dim = getattr(module, "head_dim", None) or _infer_head_dim(module)
        new = cls(in_proj.in_features, module.num_heads, attn_head_dim=head_dim, dim_out=module.proj.out_features,
                  num_prefix_tokens=num_prefix_tokens, grid_size=grid_size, device="meta", dtype=weight.dtype,
                  **options)
        new.copy_matched(module)
        new.to_empty(device=weight.device)
        new.copy_matched_values(module)
        new.k_bias = None if getattr(module, "k_bias", None) is None else module.k_bias.detach().clone()
        new.reset_extra_parameters()
        return new

    def copy_matched(self, like: nn.Module) -> None:
        """Take ``like``'s layout of the matched parts (its projections, norms, biases, dropout, as modules of
        the same kind and shape; values come by name after) and its layout details."""
        self.num_kv_heads = getattr(like, "num_kv_heads", None) or self.num_heads
        self.rotate_half = bool(getattr(like, "rotate_half", False))
        for name in MATCHED_MODULES:
            child = getattr(like, name, None)
            setattr(self, name, meta_copy(child) if child is not None else None)
        if self.q_norm is None:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        if self.norm is None:
            self.norm = nn.Identity()
        for name in MATCHED_PARAMS:
            p = getattr(like, name, None)
            setattr(self, name, nn.Parameter(torch.empty_like(p, device="meta")) if p is not None else None)
        self.dropped = [n for n in DROPPED if getattr(like, n, None) is not None]
        self.proj_drop = copy.deepcopy(getattr(like, "proj_drop", nn.Identity()))

    @torch.no_grad()
    def copy_matched_values(self, like: nn.Module) -> None:
        """Every tensor of the matched parts (parameters and buffers) takes ``like``'s value of the same name."""
        values = {**dict(like.named_parameters()), **dict(like.named_buffers())}
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if name.split(".")[0] in MATCHED_MODULES + MATCHED_PARAMS:
                tensor.copy_(values[name])

    @classmethod
    def configure(cls, **defaults: Any) -> type[LinearAttention]:
        """A subclass whose constructor defaults to ``defaults`` (options, ``num_prefix_tokens``, ``grid_size``):
        timm's ``attn_layer=`` takes a class, so this is how a variant's options reach it."""
        valid = set(cls.default_options) | set(inspect.signature(LinearAttention.__init__).parameters)
        unknown = set(defaults) - (valid - {"self", "options", "dim"})
        if unknown:
            raise ValueError(f"{cls.__name__}.configure: unknown argument(s) {', '.join(sorted(unknown))}")

        class Configured(cls):  # type: ignore[valid-type, misc]  (a subclass of whichever variant is asked)
            declared_options = with_defaults(cls.declared_options, defaults, cls.variant)

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**defaults, **kwargs})

        # named as the variant, in this module: TorchScript must not take it for the variant's own class
        Configured.__name__, Configured.__qualname__ = cls.__name__, cls.__qualname__
        return Configured

    def init_weights(self) -> None:
        """Called by timm's ViT weight init after its own init of the Linear layers: the extras' init."""
        self.reset_extra_parameters()

    def init_non_persistent_buffers(self) -> None:
        """The buffers no checkpoint holds, as timm's EVA/BEiT attention recomputes them after a meta-device build
        (``to_empty`` + load; transformers and ``timm.models.reinit_non_persistent_buffers`` call this): k_bias,
        the key bias those families fix at zero."""
        if self.k_bias is not None:
            self.k_bias.zero_()

    # -- the parts a variant provides -------------------------------------------------------------
    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], grid: Grid,
            extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Fast O(N) token mixing: (B, H, N, d) q, k, v -> (B, H, N, d); ``extra`` comes from :meth:`prepare`."""
        raise NotImplementedError

    def reference(self, q, k, v, key_valid: Optional[torch.Tensor], grid: Grid) -> torch.Tensor:
        """Slow, literal form of the variant's formula; the oracle of the tests."""
        raise NotImplementedError

    def reset_extra_parameters(self) -> None:
        """Give the parameters softmax attention does not have their method's default init."""

    def pinned_options(self) -> dict[str, Any]:
        """Options that rebuild this module's parameter shapes on any image size (what timm's model_args store)."""
        return dict(self.options)

    # -- shared machinery --------------------------------------------------------------------------
    def extra_parameter_names(self) -> list[str]:
        """Names (relative to this module) of parameters with no softmax counterpart."""
        matched = MATCHED_MODULES + MATCHED_PARAMS
        return [n for n, _ in self.named_parameters() if n.split(".")[0] not in matched]

    def qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of W_q, W_k, W_v, each (attn_dim, dim), whatever the projection layout."""
        if self.qkv is not None:
            return tuple(self.qkv.weight.split(self.attn_dim, dim=0))  # type: ignore[return-value]
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight

    def qkv_biases(self) -> list[torch.Tensor]:
        """Every bias of the q/k/v projections (to zero them or copy them)."""
        biases = [self.q_bias, self.v_bias]
        for lin in (self.qkv, self.q_proj, self.k_proj, self.v_proj):
            if lin is not None:
                biases.append(lin.bias)
        return [b for b in biases if b is not None]

    def fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, 3·C) of the fused qkv projection, as the softmax module computed it (MHLA folds its input norm in)."""
        return self.qkv_linear(x) if self.qkv is not None else x

    def qkv_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The fused qkv linear alone, with the split q/k/v biases where the source had them (BEiT, EVA)."""
        assert self.qkv is not None
        if self.q_bias is not None:
            out = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
            return out + self.qkv.bias if self.qkv.bias is not None else out
        return self.qkv(x)

    def project(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None):
        """q, k, v as (B, H, N, d), computed exactly as the softmax module computed them."""
        B, N, _ = x.shape
        if self.qkv is not None:
            qkv = self.fused_qkv(x)
            # unbind over the q/k/v axis before the heads' transpose: the same views as timm's permute-then-unbind,
            # but the unbind's backward stacks the three gradients straight into the (B, N, 3, H, d) layout of the
            # projection's output (one pass), where stacking them head-major needed a second, the reshape's copy
            q, k, v = [t.transpose(1, 2) for t in qkv.reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)]
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            npt = self.num_prefix_tokens
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=self.rotate_half)], 2)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=self.rotate_half)], 2)
            q, k = q.type_as(v), k.type_as(v)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def set_window_size(self, window_size: tuple[int, int]) -> None:
        """The patch grid after timm's ``set_input_size`` (BEiT calls this on every attention module)."""
        self.grid_size = (int(window_size[0]), int(window_size[1]))

    def resolve_grid(self, tokens: int) -> Grid:
        """The (H, W) patch grid of this call: the model's grid, or a square one for other image sizes; None when
        the spatial tokens form no known grid (e.g. NaFlex's packed patches: variants use their grid-free form)."""
        if not torch.jit.is_scripting():  # (TorchScript compiles no branch of is_scripting() alone)
            if torch.jit.is_tracing():
                return self._traced_grid(tokens)
        return self._grid_for(tokens)

    def _grid_for(self, tokens: int) -> Grid:
        spatial = tokens - self.num_prefix_tokens
        grid = self.grid_size
        if grid is not None:
            if grid[0] * grid[1] == spatial:
                return grid
        side = int(math.sqrt(max(spatial, 0)))  # exact for squares below 2**52 (math.isqrt is not TorchScript)
        if side > 0 and side * side == spatial:
            return (side, side)
        return None

    @torch.jit.unused
    def _traced_grid(self, tokens: Any) -> Grid:
        """Under torch.jit.trace a size is a tensor: its value read once, not a TracerWarning per layer (a trace is
        fixed to its input's size anyway, as timm's patch embedding says)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            count = int(tokens)
        return self._grid_for(count)

    def prepare(self, x: torch.Tensor, key_valid: Optional[torch.Tensor],
                grid: Grid) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the input to project, an extra tensor for ``mix``/``reference``) of one call. A variant that needs more
        than q, k, v (InLine's predicted kernels, MHLA's input norm) computes it here and passes it down: nothing
        is stored on the module, and ``forward`` is the same for every variant."""
        return x, None

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        rope: Optional[torch.Tensor] = None,
        shared_rel_pos_bias: Optional[torch.Tensor] = None,  # BEiT's and relpos ViTs' shared softmax logit biases:
        shared_rel_pos: Optional[torch.Tensor] = None,  # no linear analogue, ignored (docs/variants.md)
    ) -> torch.Tensor:
        """timm's attention call (the arguments its ViT, EVA, BEiT and relpos blocks pass, by name)."""
        if is_causal:
            raise ValueError("linear attention here is bidirectional; is_causal=True is not supported")
        B, N, _ = x.shape
        key_valid, grid = key_validity(attn_mask, B, N), self.resolve_grid(N)
        x, extra = self.prepare(x, key_valid, grid)
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project(x, rope)
        if not self.use_reference:
            out = self.mix(q, k, v, key_valid, grid, extra)
        elif torch.jit.is_scripting():  # the oracles are Python loops and autograd calls: not compiled
            raise RuntimeError("use_reference (the slow reference form) runs in eager mode only")
        else:
            out = self.reference(q, k, v, key_valid, grid, *([] if extra is None else [extra]))
        out = out.transpose(1, 2).reshape(B, N, self.attn_dim)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in in_effect(self.declared_options, self.options).items())
        head = f"variant={self.variant}, heads={self.num_heads}, head_dim={self.head_dim}"
        return head + (f", {opts}" if opts else "")


register_notrace_module(LinearAttention)  # an FX leaf, subclasses included (timm's tracer tests isinstance)


def meta_copy(module: nn.Module) -> nn.Module:
    """``module``'s structure (its kind, shapes, settings such as a norm's eps) on the meta device, without copying
    its values: they come by name once materialised."""
    memo: dict[int, Any] = {id(b): torch.empty_like(b, device="meta") for b in module.buffers()}
    memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                 for p in module.parameters()})
    return copy.deepcopy(module, memo)


def _infer_head_dim(like: nn.Module) -> int:
    out = like.qkv.out_features // 3 if getattr(like, "qkv", None) is not None else like.q_proj.out_features
    return out // like.num_heads

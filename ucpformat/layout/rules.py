"""Rule files: a model family's layout semantics, described once by name patterns.

A rule file (JSON, schema ``schemas/1.0/rules.schema.json``) maps tensor-name patterns to
layout semantics and the framework's local conventions. Patterns are literal names with
``{layer}`` and ``{expert}`` (captured integers: the global layer and expert index),
``*`` (one dotted component) and ``**`` (anything). Integers in a layout may be
expressions over the file's parameters (``"num_query_groups * kv_channels"``), given when
the rules are applied. The first matching rule wins. Importers use rule files to
consolidate another framework's rank files; loaders use them to produce a framework's
local tensors. Spec chapter "Layout semantics", UCP-1.0-R120 and up.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucpformat.errors import LayoutError
from ucpformat.format import schemas
from ucpformat.format.jsonvalues import MAX_DOCUMENT_DEPTH, json_depth
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords
from ucpformat.layout.semantics import PART_MAJOR, TensorLayout

BUILTIN_DIR = Path(__file__).resolve().parent / "rules"


def builtin_rule_files() -> list[str]:
    """Names of the rule files shipped with ucpformat (``llama``, ``megatron-gpt``, ...)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


CAPTURES = ("layer", "expert")

_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


_PARSE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1024)
def _parse(expr: str) -> ast.Expression:
    # CPython 3.11's parser is not thread-safe ("AST constructor recursion depth
    # mismatch" when ranks resolve rules on threads): parse each expression once, alone
    with _PARSE_LOCK:
        return ast.parse(expr, mode="eval")


#: Longest integer expression in a rule file.
MAX_EXPRESSION_CHARS = 200
_PLACEHOLDER = re.compile(r"\{([a-z]*)\}")


def expand_captures(template: str, captures: Mapping[str, int], *, where: str) -> str:
    """``template`` with ``{layer}`` and ``{expert}`` replaced; nothing else is a field.

    (``str.format`` would accept attribute access and widths chosen by the rule file.)
    """
    def field(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in CAPTURES or name not in captures:
            raise LayoutError(
                f"tied_to {template!r} uses {{{name}}}, which the pattern does not capture",
                rule="UCP-1.0-R120",
                path=where,
            )
        return str(captures[name])

    out = _PLACEHOLDER.sub(field, template)
    if "{" in out or "}" in out:
        raise LayoutError(f"tied_to {template!r} has a brace outside {{layer}}/{{expert}}",
                          rule="UCP-1.0-R120", path=where)
    return out


def evaluate(expr: Any, params: Mapping[str, Any], *, where: str) -> Any:
    """An integer, or an integer expression over ``params`` (+ - * //, parentheses)."""
    if isinstance(expr, (bool, int)):
        return expr
    if not isinstance(expr, str):
        return expr
    if len(expr) > MAX_EXPRESSION_CHARS:
        # bounds the parser's recursion and the size of every number (UCP-1.0-R097)
        raise LayoutError(
            f"expression of {len(expr)} characters, over the limit of {MAX_EXPRESSION_CHARS}",
            rule="UCP-1.0-R121",
            path=where,
        )
    try:
        tree = _parse(expr)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise LayoutError(f"bad expression {expr!r}", rule="UCP-1.0-R121", path=where) from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in params:
                raise LayoutError(
                    f"expression {expr!r} needs parameter {node.id!r}",
                    rule="UCP-1.0-R121",
                    path=where,
                )
            value = params[node.id]
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(
                    f"parameter {node.id!r} must be an integer", rule="UCP-1.0-R121", path=where
                )
            return value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise LayoutError(f"division by zero in {expr!r}", rule="UCP-1.0-R121", path=where)
            return _BINOPS[type(node.op)](left, right)
        raise LayoutError(
            f"expression {expr!r} may only use integers, parameters, + - * // ()",
            rule="UCP-1.0-R121",
            path=where,
        )

    return ev(tree)


def _evaluate_tree(doc: Any, params: Mapping[str, Any], where: str) -> Any:
    if isinstance(doc, Mapping):
        return {k: (v if k == "name" else _evaluate_tree(v, params, where)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_evaluate_tree(v, params, where) for v in doc]
    return evaluate(doc, params, where=where)


def _compile(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".+")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]+")
            i += 1
        elif pattern[i] == "{":
            end = pattern.find("}", i)
            if end < 0:
                raise LayoutError(f"unclosed {{ in pattern {pattern!r}", rule="UCP-1.0-R120")
            name = pattern[i + 1 : end]
            if name not in CAPTURES:
                raise LayoutError(
                    f"unknown capture {{{name}}} in pattern {pattern!r}", rule="UCP-1.0-R120"
                )
            out.append(rf"(?P<{name}>0|[1-9][0-9]*)")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    try:
        return re.compile("^" + "".join(out) + "$")
    except re.error as exc:  # e.g. a capture used twice
        raise LayoutError(f"bad pattern {pattern!r}: {exc}", rule="UCP-1.0-R120") from None


@dataclass(frozen=True)
class Rule:
    pattern: str
    regex: re.Pattern[str]
    layout: Mapping[str, Any]
    fused_order: str | None
    stage: str | None
    tied_to: str | None
    when: str | None
    ignore: bool


@dataclass(frozen=True)
class Resolved:
    """What the rules say about one consolidated tensor name."""

    name: str
    layout: TensorLayout
    conventions: Conventions
    tied_to: str | None = None
    layer: int | None = None
    expert: int | None = None


@dataclass
class RuleSet:
    """A parsed rule file."""

    name: str
    description: str
    parameters: tuple[str, ...]
    conventions: Mapping[str, Any]
    rules: list[Rule] = field(default_factory=list)

    @staticmethod
    def from_json(doc: Any, *, source: str = "<rules>") -> RuleSet:
        if json_depth(doc) > MAX_DOCUMENT_DEPTH:
            raise LayoutError(f"the rule file nests deeper than {MAX_DOCUMENT_DEPTH} levels",
                              rule="UCP-1.0-R096", path=source)
        problems = schemas.violations("rules", doc)
        if problems:
            first = problems[0]
            raise LayoutError(
                f"{first.message} (at {first.pointer})",
                rule=first.rule or "UCP-1.0-R120",
                path=source,
            )
        rules = []
        for r in doc["rules"]:
            rules.append(
                Rule(
                    pattern=r["pattern"],
                    regex=_compile(r["pattern"]),
                    layout=r.get("layout", {}),
                    fused_order=r.get("fused_order"),
                    stage=r.get("stage"),
                    tied_to=r.get("tied_to"),
                    when=r.get("when"),
                    ignore=bool(r.get("ignore", False)),
                )
            )
        return RuleSet(
            name=doc["name"],
            description=doc.get("description", ""),
            parameters=tuple(doc.get("parameters", [])),
            conventions=doc.get("conventions", {}),
            rules=rules,
        )

    @staticmethod
    def load(name_or_path: str | Path) -> RuleSet:
        """A built-in rule file by name (one of :func:`builtin_rule_files`) or a path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = BUILTIN_DIR / f"{name_or_path}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (RecursionError, UnicodeDecodeError) as exc:  # hostile nesting or bytes
            raise LayoutError(f"not JSON: {exc}", rule="UCP-1.0-R120", path=str(path)) from None
        except FileNotFoundError:
            raise LayoutError(
                f"no rule file {str(name_or_path)!r} (built in: {builtin_rule_files()})",
                rule="UCP-1.0-R120",
            ) from None
        except json.JSONDecodeError as exc:
            raise LayoutError(f"not JSON: {exc}", rule="UCP-1.0-R120", path=str(path)) from None
        return RuleSet.from_json(doc, source=str(path))

    # -- matching -----------------------------------------------------------------------

    def match(self, name: str, params: Mapping[str, Any]) -> tuple[Rule, dict[str, int]] | None:
        for rule in self.rules:
            if rule.when is not None and not params.get(rule.when):
                continue
            m = rule.regex.match(name)
            if m:
                return rule, {k: int(v) for k, v in m.groupdict().items()}
        return None

    def resolve(self, name: str, params: Mapping[str, Any]) -> Resolved | None:
        """Layout semantics and conventions for a consolidated (global) name; None if ignored."""
        found = self.match(name, params)
        if found is None:
            raise LayoutError(
                f"no rule of {self.name!r} matches this tensor", rule="UCP-1.0-R122", tensor=name
            )
        rule, caps = found
        if rule.ignore:
            return None
        doc = dict(_evaluate_tree(rule.layout, params, name))
        for key in CAPTURES:
            if key in caps:
                doc.setdefault(key, caps[key])
        vocab = doc.get("vocab")
        if isinstance(vocab, Mapping):  # "size" is a save-time hint, not stored
            doc["vocab"] = {"dim": vocab["dim"]}
        layout = TensorLayout.from_json(doc, tensor=name)
        conv = Conventions(
            fused_order=rule.fused_order or self.conventions.get("fused_order", PART_MAJOR),
            stage=rule.stage or "all",
            vocab_multiple=params.get("vocab_multiple", self.conventions.get("vocab_multiple")),
        )
        tied = None
        if rule.tied_to is not None:
            tied = expand_captures(rule.tied_to, caps, where=name)
        return Resolved(name, layout, conv, tied, caps.get("layer"), caps.get("expert"))

    def vocab_size_hint(self, name: str, params: Mapping[str, Any]) -> int | None:
        found = self.match(name, params)
        if found is None:
            return None
        vocab = found[0].layout.get("vocab")
        if isinstance(vocab, Mapping) and "size" in vocab:
            value = evaluate(vocab["size"], params, where=name)
            return int(value)
        return None

    # -- local <-> global names ------------------------------------------------------------

    def _renumber(
        self,
        name: str,
        params: Mapping[str, Any],
        cfg: ParallelConfig,
        coords: RankCoords,
        direction: int,
    ) -> str:
        found = self.match(name, params)
        if found is None:
            return name
        rule, caps = found
        layer_local = self.conventions.get("layer_numbering", "global") == "stage-local"
        expert_local = self.conventions.get("expert_numbering", "global") == "rank-local"
        new = dict(caps)
        if "layer" in caps and layer_local:
            start = 0 if cfg.pp == 1 else cfg.stage_layers(coords.pp).start
            new["layer"] = caps["layer"] + direction * start
        if "expert" in caps and expert_local:
            if cfg.num_experts is None:
                raise LayoutError(
                    "num_experts is needed to renumber experts", rule="UCP-1.0-R111", tensor=name
                )
            per = cfg.num_experts // cfg.ep
            new["expert"] = caps["expert"] + direction * per * coords.ep(cfg)
        if new == caps:
            return name
        m = rule.regex.match(name)
        assert m is not None
        out, last = [], 0
        for key in m.groupdict():
            s, e = m.span(key)
            out.append(name[last:s])
            out.append(str(new[key]))
            last = e
        out.append(name[last:])
        return "".join(out)

    def global_name(
        self, local_name: str, params: Mapping[str, Any], cfg: ParallelConfig, coords: RankCoords
    ) -> str:
        """The consolidated name of a framework-local name on rank ``coords``."""
        return self._renumber(local_name, params, cfg, coords, +1)

    def local_name(
        self, global_name: str, params: Mapping[str, Any], cfg: ParallelConfig, coords: RankCoords
    ) -> str:
        """The framework-local name of a consolidated name on rank ``coords``."""
        return self._renumber(global_name, params, cfg, coords, -1)

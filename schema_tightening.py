"""A client's JSON schema as structured.py hands it to llguidance: no deeper than
MAX_DEPTH through its references, and tightened where that cannot change what the schema
accepts beyond leaving out what a model would wander into (digits or keys until max_tokens
cuts the answer). Every answer still meets the schema as the client wrote it, and a schema
that has answers keeps some:

- an integer or number unbounded on a side is bounded there to ±(2^53 − 1) (JavaScript's
  safe integers), or 2^53 − 1 past the schema's own bound on the other side where that lies
  further out; a number without multipleOf gets at most 9 decimals where its bounds allow one;
  none of this beside enum or const;
- an object that names its properties, requires none besides them and says nothing of other
  keys (additionalProperties, patternProperties, minProperties, ...) takes no others (as
  vLLM's default backend, xgrammar, does in its strict mode), unless it combines or refers to
  other schemas (allOf, anyOf, $ref, ...), is a part of an allOf (which names only some of
  the keys), of an anyOf beside other keywords, or is referred to beside other keywords;
- nothing in oneOf (whose parts must not match together: a part tightened could hide an
  overlap), not, if/then/else, contains, propertyNames, dependentSchemas or keywords unknown
  here, nor in what those refer to;
- a count written as a whole float (maxItems: 2.0) is that integer (llguidance takes integers).

A $ref this module cannot follow (to another document, which llguidance does not fetch) is
refused, so that MAX_DEPTH counts every path ($dynamicRef is llguidance's to refuse). The walks are iterative: a schema is as deep as the JSON it came in (json_nesting), and its
references can make it deeper, which is what MAX_DEPTH bounds (llguidance's compiler
recurses through references: a chain of about 950 overflowed its stack here)."""

import json
from decimal import Decimal
from urllib.parse import unquote, urljoin

MAX_DEPTH = 64  # subschemas within each other, counting each reference followed
SAFE = (1 << 53) - 1  # what every JSON parser reads exactly (JavaScript's too)
DECIMALS = Decimal("1e-9")  # a number's finest step when its schema gives none
VALUES = {"const", "enum", "default", "examples"}  # keywords whose values are JSON values, not schemas
DEFINITIONS = {"$defs", "definitions"}  # schemas reached only through references
MAPPINGS = {"properties", "patternProperties", "dependentSchemas"} | DEFINITIONS  # their values: {name: schema}
ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$anchor"} | DEFINITIONS
# what an object's schema may say of other keys, or how it combines or refers to other schemas: never closed
NOT_CLOSED = {"additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames", "minProperties",
              "dependentRequired", "dependentSchemas", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
              "$ref", "$dynamicRef"}
COUNTS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
          "maxContains"}
BASE = "json-schema:///root.json"  # the base URI of a schema without $id
EXACT, BOUNDED, CLOSED = 0, 1, 2  # how far a subschema may be tightened: not at all, numbers, numbers and objects


def tightened(schema: dict) -> dict:
    """A tightened copy of schema (a JSON object). Raises ValueError for a reference it
    cannot follow or a schema too deep."""
    schema = json.loads(json.dumps(schema))  # a copy of JSON no deeper than json_nesting.MAX_DEPTH
    graph = Graph(schema)
    check_depth(graph)
    for node, mode in modes(graph).items():
        tighten(graph.nodes[node], mode)
    return schema


# --- the schema as a graph ---------------------------------------------------------------------

class Graph:
    """A schema's subschemas (every object in it but JSON values), by id(), each with its
    edges: the subschemas it applies (by keyword, $defs left out) and the one its $ref leads
    to, resolved as JSON Schema 2020-12 does, against the base URI that $id gives, to a JSON
    pointer or an $anchor."""

    def __init__(self, root: dict):
        self.root = root
        self.nodes: dict[int, dict] = {}
        self.base: dict[int, str] = {}
        self.edges: dict[int, list[tuple[str, dict]]] = {}
        self.resources: dict[str, dict] = {}  # absolute URI (no fragment): the schema with that $id
        self.anchors: dict[str, dict] = {}  # URI#name: the schema with that $anchor or $dynamicAnchor
        stack = [(root, BASE)]
        while stack:
            node, base = stack.pop()
            if isinstance(node.get("$id"), str):
                base = join(base, node["$id"]).partition("#")[0]
            if node is root or isinstance(node.get("$id"), str):
                self.resources[base] = node
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self.anchors[f"{base}#{node[key]}"] = node
            subschemas = children(node)
            self.nodes[id(node)], self.base[id(node)] = node, base
            self.edges[id(node)] = [(key, child) for key, child in subschemas if key not in DEFINITIONS]
            stack += [(child, base) for _, child in subschemas]
        for node in self.nodes.values():
            if "$ref" in node and isinstance(target := self.target(node), dict):
                self.edges[id(node)].append(("$ref", target))

    def target(self, node: dict) -> dict | bool:
        """The schema (an object or a boolean) that node's $ref leads to. ValueError if none."""
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise ValueError(f"$ref must be a string, got {json.dumps(ref)}")
        uri, _, fragment = join(self.base[id(node)], ref).partition("#")
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            found = self.anchors.get(f"{uri}#{fragment}")
        else:
            found = self.resources.get(uri)
            for part in fragment.split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                is_index = isinstance(found, list) and part.isdigit() and int(part) < len(found)
                found = found[int(part)] if is_index else found.get(part) if isinstance(found, dict) else None
        if not isinstance(found, (dict, bool)):
            raise ValueError(f"$ref {ref!r} leads nowhere in the schema (references to other documents are "
                             "not supported)")
        return found


def join(base: str, ref: str) -> str:
    return base.partition("#")[0] + ref if ref.startswith("#") else urljoin(base, ref)


def children(node: dict) -> list[tuple[str, dict]]:
    """(keyword, subschema) for every object under node's keywords, but JSON values."""
    out = []
    for key, value in node.items():
        if isinstance(value, dict) and key not in VALUES:
            out += [(key, v) for v in value.values() if isinstance(v, dict)] if key in MAPPINGS else [(key, value)]
        elif isinstance(value, list) and key not in VALUES:
            out += [(key, v) for v in value if isinstance(v, dict)]
    return out


def check_depth(graph: Graph):
    """ValueError if a path from the root through subschemas and references is longer than
    MAX_DEPTH (a reference back to a schema on the path, recursion, ends it)."""
    height: dict[int, int] = {}  # of each schema whose subschemas are all done: its longest path down
    below = {id(graph.root): 0}
    path = [(graph.root, iter(graph.edges[id(graph.root)]))]
    while path:
        node, edges = path[-1]
        child = next(edges, (None, None))[1]
        if child is None:
            path.pop()
            height[id(node)] = below.pop(id(node)) + 1
            if height[id(node)] > MAX_DEPTH:
                raise ValueError(f"it nests schemas more than {MAX_DEPTH} levels deep, counting each $ref "
                                 "it follows")
            if path:
                parent = id(path[-1][0])
                below[parent] = max(below[parent], height[id(node)])
        elif id(child) in height:
            below[id(node)] = max(below[id(node)], height[id(child)])
        elif id(child) not in below:  # else it is on the path
            below[id(child)] = 0
            path.append((child, iter(graph.edges[id(child)])))


# --- how far each subschema may be tightened ----------------------------------------------------

def modes(graph: Graph) -> dict[int, int]:
    """Each subschema reached from the root (by id): the least of EXACT, BOUNDED and CLOSED
    that any way to it allows."""
    mode: dict[int, int] = {}
    todo = [(graph.root, CLOSED)]
    while todo:
        node, m = todo.pop()
        if mode.get(id(node), CLOSED + 1) <= m:
            continue
        mode[id(node)] = m
        todo += [(child, edge_mode(node, key, m)) for key, child in graph.edges[id(node)]]
    return mode


def edge_mode(node: dict, key: str, m: int) -> int:
    """The mode of a subschema of node (of mode m) under keyword key."""
    if key == "$ref":
        return m if set(node) <= ANNOTATIONS | {"$ref"} else min(m, BOUNDED)
    if key in ("properties", "patternProperties"):  # a key in both has to meet both
        return min(m, BOUNDED) if "properties" in node and "patternProperties" in node else m
    if key in ("additionalProperties", "items", "prefixItems"):
        return m
    if key == "allOf":
        return min(m, BOUNDED)
    if key == "anyOf":
        return m if set(node) <= ANNOTATIONS | {"anyOf", "type"} else min(m, BOUNDED)
    return EXACT


# --- tightening one subschema -------------------------------------------------------------------

def tighten(node: dict, mode: int):
    """node tightened in place as far as mode allows."""
    for key in COUNTS & node.keys():
        if isinstance(node[key], float) and node[key].is_integer():
            node[key] = int(node[key])
    if mode >= BOUNDED and not {"const", "enum"} & node.keys():
        bound_numbers(node)
    if mode == CLOSED and closable(node):
        node["additionalProperties"] = False


def kinds(node: dict) -> list:
    kind = node.get("type")
    return kind if isinstance(kind, list) else [kind]


def closable(node: dict) -> bool:
    properties, required = node.get("properties"), node.get("required", [])
    return ("object" in kinds(node) and isinstance(properties, dict) and not NOT_CLOSED & node.keys()
            and isinstance(required, list) and all(isinstance(k, str) and k in properties for k in required))


def bound_numbers(node: dict):
    """An integer's or number's open sides bounded, and a number's decimals, in place."""
    if not {"integer", "number"} & set(kinds(node)):
        return
    bounds = {k: node[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in node}
    if not all(is_number(v) for v in bounds.values()):
        return  # llguidance says what is wrong with it
    lo, hi = bound(node, "minimum", "exclusiveMinimum", max), bound(node, "maximum", "exclusiveMaximum", min)
    if lo is None:
        edge = -SAFE if hi is None or hi > -SAFE else hi - SAFE
        if hi is None or edge < hi:
            node["minimum"] = lo = edge
    if hi is None:
        edge = SAFE if lo < SAFE else lo + SAFE
        if edge > lo:
            node["maximum"] = hi = edge
    if "number" in kinds(node) and "multipleOf" not in node and has_a_multiple(node, lo, hi):
        node["multipleOf"] = float(DECIMALS)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bound(node: dict, inclusive: str, exclusive: str, tighter):
    """The schema's bound on one side (the tighter of the two keywords where both are given)."""
    given = [node[k] for k in (inclusive, exclusive) if k in node]
    return tighter(given) if given else None


def has_a_multiple(node: dict, lo, hi) -> bool:
    """Whether a multiple of DECIMALS lies within node's bounds lo and hi (both within the
    safe integers, with at most 9 decimals: else its decimals are left free)."""
    if lo is None or hi is None or not -SAFE <= lo <= hi <= SAFE:
        return False
    lo, hi = Decimal(repr(lo)), Decimal(repr(hi))
    if lo % DECIMALS or hi % DECIMALS:
        return False
    first = lo + DECIMALS if node.get("exclusiveMinimum") == lo else lo
    last = hi - DECIMALS if node.get("exclusiveMaximum") == hi else hi
    return first <= last

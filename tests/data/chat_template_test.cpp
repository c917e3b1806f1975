// The chat-template engine against jinja2 3.1 configured as transformers 5 configures it: the
// fixture conversations rendered with Qwen3's template and four variants a fine-tuned checkpoint
// ships (fixtures/chat/golden.jsonl, written by gen_chat_golden.py; ids where transformers wrote
// them), each construct on its own (expected texts from jinja2), every refusal by its line,
// provenance, and the {% generation %} spans.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "data_test_util.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string fixtures() { return std::string(LCX_TEST_DATA_DIR) + "/data/fixtures/chat/"; }

std::vector<ordered_json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<ordered_json> rows;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(ordered_json::parse(line));
  return rows;
}

// The variables transformers hands the template: messages, tools (None when absent), documents,
// add_generation_prompt, the tokenizer's special tokens and the call's keyword arguments.
ordered_json context_of(const ordered_json& conv, const ordered_json& special_tokens) {
  ordered_json ctx;
  ctx["messages"] = conv["messages"];
  ctx["tools"] = conv.contains("tools") ? conv["tools"] : ordered_json();
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = conv["add_generation_prompt"];
  for (const auto& [k, v] : special_tokens.items()) ctx[k] = v;
  for (const auto& [k, v] : conv["kwargs"].items()) ctx[k] = v;
  return ctx;
}

std::string render_text(const std::string& source, const ordered_json& ctx) {
  return ChatTemplate::parse(source, "t.jinja").render(ctx).text;
}

TEST(ChatTemplate, GoldenFixture) {
  const auto convs = read_jsonl(fixtures() + "conversations.jsonl");
  const auto golden_rows = read_jsonl(fixtures() + "golden.jsonl");
  ASSERT_GE(convs.size(), 48u);
  std::map<std::string, ordered_json> golden;
  for (const auto& g : golden_rows) golden[g["name"].get<std::string>()] = g;
  std::map<std::string, ChatTemplate> templates;
  const std::string tok_path = test::qwen3_tokenizer_path();
  std::unique_ptr<Tokenizer> tok;
  if (!tok_path.empty()) tok = std::make_unique<Tokenizer>(Tokenizer::load(tok_path));
  int with_ids = 0, refused = 0;
  for (const auto& conv : convs) {
    const std::string name = conv["name"], tname = conv["template"];
    SCOPED_TRACE(name);
    ASSERT_TRUE(golden.count(name)) << "no golden row: run tests/data/gen_chat_golden.py";
    const ordered_json& g = golden[name];
    if (!templates.count(tname))
      templates.emplace(tname, ChatTemplate::parse(test::read_file(fixtures() + "templates/" + tname + ".jinja"),
                                                   tname + ".jinja"));
    const ChatTemplate& t = templates.at(tname);
    EXPECT_EQ(t.has_generation_blocks(), tname == "qwen3_generation");
    const ordered_json ctx = context_of(conv, g["special_tokens"]);
    if (g.contains("error")) {
      const auto thrown = test::thrown_by([&] { t.render(ctx); });
      EXPECT_TRUE(thrown.thrown) << "the golden engine refused it: " << g["error"];
      EXPECT_EQ(thrown.key, "chat_template");
      EXPECT_EQ(thrown.message.rfind(tname + ".jinja:", 0), 0u) << thrown.message;
      ++refused;
      continue;
    }
    RenderedText r;
    ASSERT_NO_THROW(r = t.render(ctx));
    EXPECT_EQ(r.text, g["text"].get<std::string>());
    EXPECT_EQ(r.from_data.size(), r.text.size());
    if (g.contains("generation")) {
      std::vector<std::pair<int64_t, int64_t>> want;
      for (const auto& s : g["generation"]) want.emplace_back(s[0].get<int64_t>(), s[1].get<int64_t>());
      EXPECT_EQ(r.generation, want);
    }
    if (g.contains("ids") && tok) {
      EXPECT_EQ(tok->encode(r.text), g["ids"].get<std::vector<int32_t>>());
      ++with_ids;
    }
  }
  EXPECT_GE(refused, 1);
  std::cout << convs.size() << " conversations, " << refused << " refused as the golden engine refused them, "
            << with_ids << " compared by ids (engine: " << golden_rows[0]["engine"].get<std::string>() << ")\n";
}

// One construct at a time; the expected texts are jinja2's (ImmutableSandboxedEnvironment,
// trim_blocks, lstrip_blocks, transformers' tojson).
struct Case {
  const char* group;
  const char* source;
  const char* expected;
};
const Case kCases[] = {
    {"Scoping", R"J({% for x in xs %}[{{ y }}]{% set y = x %}({{y}}){% endfor %}{{y}})J",
     R"J([](1)[](2)[](3))J"},
    {"Scoping", R"J({% set y = 5 %}{% for x in xs %}[{{ y }}]{% set y = x %}({{y}}){% endfor %}{{y}})J",
     R"J([5](1)[5](2)[5](3)5)J"},
    {"Scoping", R"J({% if true %}{% set z = 1 %}{% endif %}{{z}})J",
     R"J(1)J"},
    {"Scoping", R"J({% set ns = namespace(a=1, b=[]) %}{% set ns.a = ns.a + 1 %}{% set ns.c = "new" %}{{ ns.a }}{{ ns.c }}{{ ns.zz }}|)J",
     R"J(2new|)J"},
    {"Scoping", R"J({%- set ns = namespace(found=false) -%}{%- for m in msgs -%}{%- if m.role == "user" -%}{%- set ns.found = true -%}{%- endif -%}{%- endfor -%}{{ ns.found }})J",
     R"J(True)J"},
    {"Scoping", R"J({% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}  up  {% endset %}[{{ y }}])J",
     R"J([block 2][  UP  ])J"},
    {"Scoping", R"J({% set a, b = 1, 2 %}{{a}}{{b}}{% for k, v in d.items() %}{{k}}={{v}};{% endfor %}{% for a, b in [[1,2],[3,4]] %}{{a+b}}{% endfor %})J",
     R"J(12a=1;b=[1, 2];37)J"},
    {"Scoping", R"J({{ dict(a=1, b="x") }} {{ namespace(d).a }})J",
     R"J({'a': 1, 'b': 'x'} 1)J"},
    {"Loops", R"J({% for x in xs if x > 1 %}{{loop.index}}/{{loop.index0}}/{{loop.length}}/{{loop.revindex}}/{{loop.revindex0}}/{{loop.first}}/{{loop.last}}/{{loop.previtem}}/{{loop.nextitem}} {% else %}E{% endfor %})J",
     R"J(1/0/2/2/1/True/False//3 2/1/2/1/0/False/True/2/ )J"},
    {"Loops", R"J({% for x in [] %}x{% else %}E{% endfor %})J",
     R"J(E)J"},
    {"Loops", R"J({% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %})J",
     R"J(1)J"},
    {"Loops", R"J({% for x in xs %}{% for y in xs %}{{ loop.index }}{{ x }}{% endfor %}{{ loop.index }};{% endfor %})J",
     R"J(1121311;1222322;1323333;)J"},
    {"Loops", R"J({% for i in range(3) %}{{i}}{% endfor %}{{ range(1,7,2)|list }})J",
     R"J(012[1, 3, 5])J"},
    {"Loops", R"J({% for c in "hé" %}[{{ c }}]{% endfor %}{% for k in d %}{{ k }}{% endfor %})J",
     R"J([h][é]ab)J"},
    {"Loops", R"J({% for m in msgs %}{% if not loop.first %}{{ loop.previtem.role }}>{% endif %}{{ m.role }}{% endfor %})J",
     R"J(useruser>assistant)J"},
    {"Macros", R"J({% macro m(a) %}{{a}}{{g}}{% endmacro %}{% set g = 7 %}{{ m(1) }})J",
     R"J(17)J"},
    {"Macros", R"J({% set g = 7 %}{% macro m(a, b=2, c="x") %}{{a}}{{g}}{{b}}{{c}}{% endmacro %}{% set g = 8 %}{{ m(1) }}{{ m(1, 3) }}{{ m(1, c="z") }}{{ m() }})J",
     R"J(182x183x182z82x)J"},
    {"Macros", R"J({% macro f(a) -%}
  [{{ a }}]
{%- endmacro %}
{{ f(1) }}{{ f(2) }}{{ f(1) ~ "!" }})J",
     R"J([1][2][1]!)J"},
    {"Whitespace", R"J(a
  {% if true %}
    x
  {% endif %}
b
)J",
     R"J(a
    x
b)J"},
    {"Whitespace", R"J(a
  {%- if true -%}
    x
  {%- endif %}
b)J",
     R"J(axb)J"},
    {"Whitespace", R"J(a  {% if true %}x{% endif %}  b)J",
     R"J(a  x  b)J"},
    {"Whitespace", R"J({% for x in xs %}
  {{ x }}
{% endfor %}
)J",
     R"J(  1
  2
  3
)J"},
    {"Whitespace", R"J({# comment #}
x
  {# c2 #}
y {#- c3 -#}  z
)J",
     R"J(x
yz)J"},
    {"Whitespace", R"J(a {{- 1 -}} b {{ 2 }}
 c)J",
     R"J(a1b 2
 c)J"},
    {"Whitespace", R"J({%+ if true %}x{% endif +%}
y)J",
     R"J(x
y)J"},
    {"Whitespace", R"J(line1
line2
{% if true %}
x{% endif %}
)J",
     R"J(line1
line2
x)J"},
    {"Whitespace", R"J(	{% if true %}	x
	{% endif %}	
y)J",
     R"J(	x
	
y)J"},
    {"Whitespace", R"J({{ 'a' }}  {% if true %}b{% endif %})J",
     R"J(a  b)J"},
    {"Whitespace", R"J({{ 'a' }}
  {% if true %}b{% endif %})J",
     R"J(a
b)J"},
    {"Whitespace", R"J({%- if xs -%}

  A

{%- endif -%}

B)J",
     R"J(AB)J"},
    {"Whitespace", R"J({% raw -%}  {{ x }}  {%- endraw %}|)J",
     R"J({{ x }}|)J"},
    {"Whitespace", R"J({{ 'multi
line' }}{# multi
line
comment #}{{ 'after' }})J",
     R"J(multi
lineafter)J"},
    {"Operators", R"J({{ 1/2 }} {{ 4/2 }} {{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2**10 }} {{ 2**-1 }} {{ 10 // -3 }} {{ 2.0 ** 0.5 }})J",
     R"J(0.5 2.0 3 -4 2 3.0 0.5 1024 0.5 -4 1.4142135623730951)J"},
    {"Operators", R"J({{ -(xs|length) }} {{ -(1) }} {{ +1 }} {{ 1 - -1 }} {{ 2 * 3 + 4 }} {{ 2 + 3 * 4 }} {{ 2 ** 3 ** 2 }} {{ 10 - 2 - 3 }} {{ "a" ~ 2 * 3 }})J",
     R"J(-3 -1 1 2 10 14 64 5 a6)J"},
    {"Operators", R"J({{ 1 == 1.0 }} {{ true == 1 }} {{ xs == [1,2,3] }} {{ [1] == (1,) }} {{ d == {"b":[1,2],"a":1} }} {{ "a" < "b" }} {{ [1,2] < [1,3] }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }})J",
     R"J(True True True False True True True True False)J"},
    {"Operators", R"J({{ "x" in "xyz" }} {{ "w" not in "xyz" }} {{ 1 in xs }} {{ "a" in d }} {{ "z" in d }} {{ "a" in u }} {{ u in xs }})J",
     R"J(True True True True False False False)J"},
    {"Operators", R"J({{ not true }} {{ not u }} {{ u or "dflt" }} {{ 0 and 1 }} {{ 1 and "x" }} {{ none or [] }})J",
     R"J(False True dflt 0 x [])J"},
    {"Operators", R"J({{ "x" if false }}|{{ "x" if true }}|{{ 1 if n else 2 }})J",
     R"J(|x|2)J"},
    {"Operators", R"J({{ u ~ 1 }}{{ 1 ~ 2.0 ~ none ~ true }})J",
     R"J(112.0NoneTrue)J"},
    {"Operators", R"J({{ [1,2]+[3] }} {{ (1,) }} {{ () }} {{ (1,2)+(3,) }} {{ "ab"*3 }} {{ [0]*3 }})J",
     R"J([1, 2, 3] (1,) () (1, 2, 3) ababab [0, 0, 0])J"},
    {"Literals", R"J({{ "a\x41\u00e9\d\101" }} {{ "a" "b" }} {{ 'q"' }})J",
     R"J(aAé\dA ab q")J"},
    {"Literals", R"J({{ true }} {{ True }} {{ none }} {{ None }} {{ 0b101 }} {{ 0o17 }} {{ 0xff }} {{ 1_000 }} {{ 1.5e3 }} {{ 1E3 }})J",
     R"J(True True None None 5 15 255 1000 1500.0 1000.0)J"},
    {"Literals", R"J({{ [1, [2, (3, 4)], {"k": none}] }} {{ {"a": {"b": "c"}} }} {{ [{"x": 1.0}] }} {{ {"a": {"b": 1}}["a"] }})J",
     R"J([1, [2, (3, 4)], {'k': None}] {'a': {'b': 'c'}} [{'x': 1.0}] {'b': 1})J"},
    {"PythonPrinting", R"J({{ 1e-5 }} {{ 1e16 }} {{ 1e15 }} {{ 0.1+0.2 }} {{ 123456789.123 }} {{ 1/3 }} {{ 0.0001 }} {{ -0.0 }} {{ 1.5e300 }} {{ 2.5e-300 }} {{ 100.0 }} {{ 10**18 }})J",
     R"J(1e-05 1e+16 1000000000000000.0 0.30000000000000004 123456789.123 0.3333333333333333 0.0001 -0.0 1.5e+300 2.5e-300 100.0 1000000000000000000)J"},
    {"PythonPrinting", R"J({{ d }} {{ [s, "it's", none, true, 1.5, 'a"b', "x'y\"z", "tab\tnl\n"] }})J",
     R"J({'a': 1, 'b': [1, 2]} ['héllo wörld', "it's", None, True, 1.5, 'a"b', 'x\'y"z', 'tab\tnl\n'])J"},
    {"PythonPrinting", R"J({{ ["\u200b", "\xa0", "é", "中", "\U0001F600", "\x7f", "\\"] }})J",
     R"J(['\u200b', '\xa0', 'é', '中', '😀', '\x7f', '\\'])J"},
    {"PythonPrinting", R"J({{ none|string }} {{ xs|string }} {{ 1.0|string }} {{ d.items()|list }})J",
     R"J(None [1, 2, 3] 1.0 [('a', 1), ('b', [1, 2])])J"},
    {"ToJson", R"J({{ d|tojson }} {{ d|tojson(indent=2) }} {{ d|tojson(indent=0) }} {{ []|tojson(indent=2) }} {{ {}|tojson }})J",
     R"J({"a": 1, "b": [1, 2]} {
  "a": 1,
  "b": [
    1,
    2
  ]
} {
"a": 1,
"b": [
1,
2
]
} [] {})J"},
    {"ToJson", R"J({{ s|tojson }} {{ s|tojson(ensure_ascii=true) }} {{ "😀"|tojson(ensure_ascii=true) }} {{ d|tojson(separators=(",",":")) }} {{ {"b":1,"a":2}|tojson(sort_keys=true) }})J",
     R"J("héllo wörld" "h\u00e9llo w\u00f6rld" "\ud83d\ude00" {"a":1,"b":[1,2]} {"a": 2, "b": 1})J"},
    {"ToJson", R"J({{ "q\"\\\n\x01\x7f\t\b\f\r"|tojson }} {{ 1.0|tojson }} {{ 1e-7|tojson }} {{ none|tojson }} {{ [true,false]|tojson }} {{ (1,2)|tojson }} {{ {1: 2}|tojson }})J",
     R"J("q\"\\\n\u0001\t\b\f\r" 1.0 1e-07 null [true, false] [1, 2] {"1": 2})J"},
    {"ToJson", R"J({{ msgs|tojson(indent="\t") }})J",
     R"J([
	{
		"role": "user",
		"content": "a"
	},
	{
		"role": "assistant",
		"content": "b"
	}
])J"},
    {"Filters", R"J({{ s|length }} {{ xs|length }} {{ d|length }} {{ d|count }})J",
     R"J(11 3 2 2)J"},
    {"Filters", R"J({{ xs|reverse|list }} {{ s|reverse }} {{ xs|select("odd")|list }} {{ xs|reject("odd")|list }} {{ xs|map("string")|join(",") }})J",
     R"J([3, 2, 1] dlröw olléh [1, 3] [2] 1,2,3)J"},
    {"Filters", R"J({{ xs|first }} {{ d|first }} {{ d|list }} {{ s|list }} {{ xs|last }} {{ []|first }}|)J",
     R"J(1 a ['a', 'b'] ['h', 'é', 'l', 'l', 'o', ' ', 'w', 'ö', 'r', 'l', 'd'] 3 |)J"},
    {"Filters", R"J({{ "  a b  "|trim }}|{{ "xxaxx"|trim("x") }})J",
     R"J(a b|a)J"},
    {"Filters", R"J({{ "ab cd-ef(gh"|title }} {{ "hello World"|capitalize }} {{ s|upper }} {{ "ABC"|lower }})J",
     R"J(Ab Cd-Ef(Gh Hello world HÉLLO WÖRLD abc)J"},
    {"Filters", R"J({{ 2.5|round }} {{ 3|round }} {{ 2.675|round(2) }} {{ 3.14159|round(3, "floor") }} {{ 3.1|round(0,"ceil") }} {{ -2.5|round }} {{ 0.5|round }} {{ 1.5|round }})J",
     R"J(2.0 3 2.67 3.141 4.0 -2.0 0.0 2.0)J"},
    {"Filters", R"J({{ "a\nb"|indent(2) }}|{{ "a\n\nb"|indent(2, true) }}|{{ "a\n\nb"|indent(2, blank=true) }}|{{ "a\nb"|indent("> ") }})J",
     R"J(a
  b|  a

  b|a
  
  b|a
> b)J"},
    {"Filters", R"J({{ ", ".join(["a","b"]) }} {{ xs|join }} {{ xs|join(", ") }} {{ msgs|join(",", attribute="role") }})J",
     R"J(a, b 123 1, 2, 3 user,assistant)J"},
    {"Filters", R"J({{ msgs|selectattr("role", "equalto", "user")|list }} {{ msgs|rejectattr("role", "equalto", "user")|map(attribute="content")|list }} {{ msgs|map(attribute="zz", default="q")|list }} {{ msgs|selectattr("content")|list|length }})J",
     R"J([{'role': 'user', 'content': 'a'}] ['b'] ['q', 'q'] 2)J"},
    {"Filters", R"J({{ [3,1,2]|sort }} {{ ["b","A","c"]|sort }} {{ ["b","A","c"]|sort(case_sensitive=true) }} {{ [3,1,2]|sort(reverse=true) }} {{ msgs|sort(attribute="content", reverse=true)|map(attribute="role")|list }})J",
     R"J([1, 2, 3] ['A', 'b', 'c'] ['A', 'b', 'c'] [3, 2, 1] ['assistant', 'user'])J"},
    {"Filters", R"J({{ [1,2,1,3]|unique|list }} {{ ["a","A","b"]|unique|list }} {{ [1,5,3]|max }} {{ [1,5,3]|min }} {{ ["a","B"]|max }} {{ [1,2,3]|sum }} {{ [1.5,2]|sum }})J",
     R"J([1, 2, 3] ['a', 'b'] 5 1 B 6 3.5)J"},
    {"Filters", R"J({{ "3"|int }} {{ "3.7"|int }} {{ "x"|int }} {{ "x"|int(7) }} {{ 3.9|int }} {{ " 12 "|int }} {{ "3"|float }} {{ "x"|float }} {{ 3|float }} {{ "1e3"|float }} {{ -3|abs }} {{ -2.5|abs }})J",
     R"J(3 3 0 7 3 12 3.0 0.0 3.0 1000.0 3 2.5)J"},
    {"Filters", R"J({{ u|default("dflt") }} {{ ""|default("dflt") }} {{ ""|default("dflt", true) }} {{ n|d("x") }} {{ n|default("x", boolean=true) }})J",
     R"J(dflt  dflt None x)J"},
    {"Filters", R"J({{ d|items|list }} {{ u|items|list }} {{ "hello world  foo"|wordcount }} {{ "a"|safe }} {{ ("a"|safe) ~ "b" }} {{ "  lead"|indent(2, first=true) }})J",
     R"J([('a', 1), ('b', [1, 2])] [] 3 a ab     lead)J"},
    {"Filters", R"J({{ n|select("odd")|list }} {{ false|map("string")|list }} {{ 2.5 is odd }} {{ 3.0 is odd }} {{ 4.0 is even }} {{ u|list }} {{ u|first is defined }} {{ u|reverse|list }})J",
     R"J([] [] False True True [] False [])J"},
    {"Filters", R"J({{ msgs|map(attribute="x.y", default="q")|list }} {{ msgs|map(attribute="role", default=none)|list }})J",
     R"J(['q', 'q'] ['user', 'assistant'])J"},
    {"Filters", R"J({{ "abcabc"|replace("c","Z") }} {{ "abcabc"|replace("c","Z", 1) }})J",
     R"J(abZabZ abZabc)J"},
    {"Tests", R"J({{ 3 is number }} {{ true is number }} {{ d is sequence }} {{ s is iterable }} {{ 3 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ n is none }} {{ u is undefined }} {{ s is string }} {{ d is mapping }} {{ xs is sequence }})J",
     R"J(True True True True True False True True True True True True)J"},
    {"Tests", R"J({{ true is boolean }} {{ true is true }} {{ 1 is true }} {{ false is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ 1 is eq 1 }} {{ "a" is in "abc" }} {{ 2 is in xs }} {{ "abc" is lower }} {{ n is not none }} {{ u is not defined }})J",
     R"J(True True False True True True True False True True True True False True)J"},
    {"Methods", R"J({{ "a b  c".split() }} {{ "a,b,,c".split(",") }} {{ "a,b,c".split(",", 1) }} {{ "a,b,c".rsplit(",", 1) }} {{ "  a  b ".split(None, 1) }} {{ "a b c".rsplit(None, 1) }})J",
     R"J(['a', 'b', 'c'] ['a', 'b', '', 'c'] ['a', 'b,c'] ['a,b', 'c'] ['a', 'b '] ['a b', 'c'])J"},
    {"Methods", R"J({{ "abcabc".replace("b", "X") }} {{ "abcabc".replace("b", "X", 1) }} {{ "abc".replace("", "-") }})J",
     R"J(aXcaXc aXcabc -a-b-c-)J"},
    {"Methods", R"J({{ "héllo".find("l") }} {{ "héllo".rfind("l") }} {{ "abc".find("z") }} {{ "a-b-c".count("-") }})J",
     R"J(2 3 -1 2)J"},
    {"Methods", R"J({{ "  a  ".strip() }}|{{ "--a--".lstrip("-") }}|{{ "--a--".rstrip("-") }}|{{ "\n\na\n".strip("\n") }}|{{ "ab cd-ef gH1x".title() }} {{ "hELLO".capitalize() }})J",
     R"J(a|a--|--a|a|Ab Cd-Ef Gh1X Hello)J"},
    {"Methods", R"J({{ "abc".startswith("a") }} {{ "abc".startswith(("x","a")) }} {{ "abc".endswith("bc") }} {{ "abc".upper() }} {{ "AbC".lower() }} {{ "<t>x</t>".removeprefix("<t>") }})J",
     R"J(True True True ABC abc x</t>)J"},
    {"Methods", R"J({{ "a\nb\r\nc".splitlines() }} {{ "12".isdigit() }} {{ "ab".isalpha() }} {{ " ".isspace() }})J",
     R"J(['a', 'b', 'c'] True True True)J"},
    {"Methods", R"J({{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.get("a") }} {{ d.get("z") }} {{ d.get("z", 5) }})J",
     R"J([('a', 1), ('b', [1, 2])] ['a', 'b'] [1, [1, 2]] 1 None 5)J"},
    {"Methods", R"J({{ "中文".upper() }} {{ "ÀÉ"|lower }} {{ "émile"|title }} {{ "ÉCOLE".capitalize() }})J",
     R"J(中文 àé Émile École)J"},
    {"Subscripts", R"J({{ xs[5] }}|{{ xs[-1] }}|{{ xs[1:] }}|{{ xs[::-1] }}|{{ xs[::2] }}|{{ xs[-2:] }}|{{ xs[:-1] }}|{{ s[1:4] }}|{{ s[::-1] }}|{{ s[-3:] }}|{{ s[100:] }})J",
     R"J(|3|[2, 3]|[3, 2, 1]|[1, 3]|[2, 3]|[1, 2]|éll|dlröw olléh|rld|)J"},
    {"Subscripts", R"J({{ d["a"] }} {{ d["items"] is defined }} {{ msgs[0]["role"] }} {{ msgs[0].role }} {{ msgs.0.role }} {{ s[0] }} {{ s[-1] }} {{ d.zz }}|{{ d["zz"] }}|{{ n.x }}|{{ n.x is defined }})J",
     R"J(1 True user user user h d |||False)J"},
    {"Subscripts", R"J({{ xs.append }}|{{ "abc".nope }}|{{ "abc".nope is defined }})J",
     R"J(||False)J"},
    // What GPT-OSS's template leans on: a macro that defaults a variable the caller may set (and
    // sees one set at the top level after it was defined), a recursive macro over JSON schemas
    // (p['items'] of a dict without the key is its items method, so true), type tests chained,
    // a namespace holding none, slices by loop.index, `in` on a message, a loop's set not leaking.
    {"Harmony", R"J({%- macro build() -%}{%- if who is not defined %}{%- set who = "default" %}{%- endif %}{{- who }}{%- endmacro -%}{{ build() }}|{% set who = "outer" %}{{ build() }})J",
     R"J(default|outer)J"},
    {"Harmony", R"J({%- macro ts(p, req, nullable=false) -%}{%- if p.type == "array" -%}{%- if p['items'] -%}{{ ts(p['items'], req) }}[]{%- else -%}any[]{%- endif -%}{%- elif p.type is defined and p.type is iterable and p.type is not string and p.type is not mapping and p.type[0] is defined -%}{{ p.type | join(" | ") }}{%- elif p.type == "string" -%}string{%- else -%}any{%- endif -%}{{ "?" if nullable }}{%- endmacro -%}{{ ts({"type": "array", "items": {"type": "string"}}, []) }} {{ ts({"type": "array"}, []) }} {{ ts({"type": ["string", "number"]}, [], true) }} {{ ts({}, []) }})J",
     R"J(string[] any[] string | number? any)J"},
    {"Harmony", R"J({%- set last = namespace(name=none) %}{{ last.name is none }}{% set last.name = "f" %}{{ last.name is none }}|{%- for m in msgs -%}{{ msgs[loop.index:] | length }}{%- endfor -%}|{{ "role" in msgs[0] }}{{ "thinking" in msgs[0] }}|{%- set flag = false -%}{%- for x in xs -%}{%- set flag = true -%}{%- endfor -%}{{ flag }})J",
     R"J(TrueFalse|10|TrueFalse|False)J"},
    {"Harmony", R"J({{ d|tojson }} {{ s|tojson }} {{ (d.get("zz") if d.zz is defined else "json") + "!" }} {{ xs|join(" | ") }} {{ '"' + ["a", "b"]|join('" | "') + '"' }})J",
     R"J({"a": 1, "b": [1, 2]} "héllo wörld" json! 1 | 2 | 3 "a" | "b")J"},
};

TEST(ChatTemplate, ConstructsMatchJinja2) {
  const ordered_json ctx = ordered_json::parse(
      R"({"xs": [1, 2, 3], "d": {"a": 1, "b": [1, 2]}, "s": "héllo wörld", "n": null, "f": 1.5,
          "msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})");
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(c.group) + ": " + c.source);
    std::string got;
    ASSERT_NO_THROW(got = render_text(c.source, ctx));
    EXPECT_EQ(got, c.expected);
  }
}

// A refusal names the construct and "<name>:<line>".
struct Refusal {
  const char* source;
  int line;
  const char* construct;
};

TEST(ChatTemplate, RefusesAtParseOutsideTheSubset) {
  const Refusal cases[] = {
      {"a\n{% call m() %}x{% endcall %}", 2, "{% call %}"},
      {"{% include 'x.jinja' %}", 1, "{% include %}"},
      {"{% import 'x' as y %}", 1, "{% import %}"},
      {"{% from 'x' import y %}", 1, "{% from %}"},
      {"{% extends 'base' %}", 1, "{% extends %}"},
      {"{% block body %}{% endblock %}", 1, "{% block %}"},
      {"{% filter upper %}x{% endfilter %}", 1, "{% filter %}"},
      {"{% with a = 1 %}{% endwith %}", 1, "{% with %}"},
      {"{% do xs.append(1) %}", 1, "{% do %}"},
      {"{% autoescape true %}{% endautoescape %}", 1, "{% autoescape %}"},
      {"x\n\n{% for m in ms recursive %}{{ loop(m.children) }}{% endfor %}", 3, "recursive loops"},
      {"{{ x\n | format('a') }}", 2, "filter 'format'"},
      {"{{ x | urlencode }}", 1, "filter 'urlencode'"},
      {"{% if x is escaped %}{% endif %}", 1, "test 'escaped'"},
      {"\n{{ '%s, %s' % (a, b) }}", 2, "string formatting with %"},
      {"{{ f(*args) }}", 1, "*args"},
      {"{{ f(**kw) }}", 1, "**kwargs"},
      {"{% set c = cycler('a', 'b') %}", 1, "cycler"},
      {"{% macro m() %}{{ varargs }}{% endmacro %}", 1, "varargs"},
      {"{% macro m() %}{{ caller() }}{% endmacro %}", 1, "caller"},
      {"{% macro m() %}\n{% generation %}x{% endgeneration %}{% endmacro %}", 2, "{% generation %} inside a macro"},
      {"{% generation %}{% generation %}x{% endgeneration %}{% endgeneration %}", 1, "inside another"},
      {"{% break %}", 1, "outside a loop"},
      {"{% if x %}\nno end", 2, "missing {% endif %}"},
      {"{{ x[1, 2] }}", 1, "several indices"},
      {"{{ '\\N{BULLET}' }}", 1, "\\N{...}"},
  };
  for (const Refusal& r : cases) {
    SCOPED_TRACE(r.source);
    const auto thrown = test::thrown_by([&] { ChatTemplate::parse(r.source, "bad.jinja"); });
    ASSERT_TRUE(thrown.thrown);
    EXPECT_EQ(thrown.key, "chat_template");
    EXPECT_EQ(thrown.message.rfind("bad.jinja:" + std::to_string(r.line) + ": ", 0), 0u) << thrown.message;
    EXPECT_NE(thrown.message.find(r.construct), std::string::npos) << thrown.message;
    EXPECT_FALSE(thrown.fix.empty());
  }
}

TEST(ChatTemplate, RefusesAtRenderWhatIsKnownOnlyThen) {
  const ordered_json ctx = ordered_json::parse(R"({"fmt": "%s!", "xs": [1, 2], "s": "Straße", "u8": "Σ"})");
  const Refusal cases[] = {
      {"\n{{ fmt % 1 }}", 2, "string formatting with %"},
      {"{{ 'a{}'.format(1) }}", 1, "str.format() is not supported"},
      {"{{ xs|reverse }}", 1, "add |list"},
      {"{{ s|upper }}", 1, "U+DF"},
      {"{{ u8.lower() }}", 1, "U+3A3"},
      {"{{ xs|map('upper')|length }}", 1, "has no len()"},
      {"x\n{{ raise_exception('roles must alternate') }}", 2, "roles must alternate"},
      {"{{ undefined_name.attr }}", 1, "'undefined_name' is undefined"},
      {"{{ xs.append(3) }}", 1, "unsafe"},
      {"{{ 'a' + 1 }}", 1, "can only concatenate str"},
      {"{% for x in none %}{% endfor %}", 1, "not iterable"},
      {"{{ 1 // 0 }}", 1, "by zero"},
      {"{{ u|int }}", 1, "'u' is undefined"},
      {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n{{ f(0) }}", 1, "recurses deeper than 200"},
      {"{{ [1] in {'a': 1} }}", 1, "unhashable type"},
      {"{{ xs|indent(2) }}", 1, "indent of a list"},
  };
  for (const Refusal& r : cases) {
    SCOPED_TRACE(r.source);
    const ChatTemplate t = ChatTemplate::parse(r.source, "run.jinja");
    const auto thrown = test::thrown_by([&] { t.render(ctx); });
    ASSERT_TRUE(thrown.thrown);
    EXPECT_EQ(thrown.key, "chat_template");
    EXPECT_EQ(thrown.message.rfind("run.jinja:" + std::to_string(r.line) + ": ", 0), 0u) << thrown.message;
    EXPECT_NE(thrown.message.find(r.construct), std::string::npos) << thrown.message;
  }
}

// A template from an untrusted file that grows a string or a list without
// bound is refused by its line once past the bound, never run until memory is gone.
TEST(ChatTemplate, RefusesGrowthWithoutBound) {
  const ordered_json ctx = ordered_json::parse(R"({"messages": []})");
  const Refusal cases[] = {
      {"{% set ns = namespace(s='x') %}\n{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", 2,
       "a string longer than the 256 MiB a template may build"},
      {"\n\n{{ 'x' * 10**12 }}", 3, "a string longer than the 256 MiB a template may build"},
      {"{% for i in range(100000) %}{{ 'abcdefgh' * 1000 }}{% endfor %}", 1,
       "a string longer than the 256 MiB a template may build"},
      {"{{ ([1, 2] * 10**12)|length }}", 1, "a list longer than the 4194304 items a template may build"},
      {"{% set ns = namespace(l=[1]) %}\n{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", 2,
       "a list longer than"},
  };
  for (const Refusal& r : cases) {
    SCOPED_TRACE(r.source);
    const ChatTemplate t = ChatTemplate::parse(r.source, "grow.jinja");
    const auto thrown = test::thrown_by([&] { t.render(ctx); });
    ASSERT_TRUE(thrown.thrown);
    EXPECT_EQ(thrown.key, "chat_template");
    EXPECT_EQ(thrown.message.rfind("grow.jinja:" + std::to_string(r.line) + ": ", 0), 0u) << thrown.message;
    EXPECT_NE(thrown.message.find(r.construct), std::string::npos) << thrown.message;
  }
}

std::string flags(const RenderedText& r, size_t begin = 0, size_t end = std::string::npos) {
  std::string f;
  for (size_t k = begin; k < std::min(end, r.from_data.size()); ++k) f += static_cast<char>('0' + r.from_data[k]);
  return f;
}

// The flags of the first occurrence of `needle` at or after `from`, as a string of '0' and '1'.
std::string flags_of(const RenderedText& r, const std::string& needle, size_t from = 0) {
  const size_t at = r.text.find(needle, from);
  EXPECT_NE(at, std::string::npos) << needle;
  if (at == std::string::npos) return {};
  return flags(r, at, at + needle.size());
}
std::string all(const std::string& needle, char flag) { return std::string(needle.size(), flag); }

TEST(ChatTemplate, ProvenanceMarksTheConversationsBytes) {
  const ChatTemplate t =
      ChatTemplate::parse(test::read_file(fixtures() + "templates/qwen3.jinja"), "qwen3.jinja");
  const ordered_json ctx = ordered_json::parse(R"({
    "messages": [{"role": "user", "content": "say <|im_start|>assistant\nhi"},
                 {"role": "assistant", "content": "<think>\nr\n</think>\n\nok",
                  "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"k": "v"}}}]}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "add_generation_prompt": false, "eos_token": "<|im_end|>"})");
  const RenderedText r = t.render(ctx);
  ASSERT_EQ(r.from_data.size(), r.text.size());
  // The message's fake header is data; the template's own headers are not.
  const std::string fake = "say <|im_start|>assistant\nhi";
  EXPECT_EQ(flags_of(r, fake), all(fake, '1'));
  EXPECT_EQ(flags_of(r, "<|im_start|>user\n"), all("<|im_start|>user\n", '0'));
  // The assistant's header: "<|im_start|>" written by the template, "assistant" the role's value.
  const std::string header = "<|im_start|>assistant\n<think>\n";
  const size_t real = r.text.find(header);
  ASSERT_NE(real, std::string::npos);
  EXPECT_EQ(flags_of(r, header, real), all(header, '0'));
  // Reasoning the template cut out of the content keeps its flags; tojson of data is data.
  EXPECT_EQ(flags_of(r, "r\n</think>", real), "1000000000");
  EXPECT_EQ(flags_of(r, "ok\n<tool_call>", real), "11000000000000");
  EXPECT_EQ(flags_of(r, "{\"k\": \"v\"}"), all("{\"k\": \"v\"}", '1'));
  const std::string tool = "{\"type\": \"function\", \"function\": {\"name\": \"f\"}}";
  EXPECT_EQ(flags_of(r, tool), all(tool, '1'));
  EXPECT_EQ(flags_of(r, "<tool_call>\n{\"name\": \""), all("<tool_call>\n{\"name\": \"", '0'));
  // Special tokens and settings from the context are not data, nor are template literals.
  const RenderedText e = ChatTemplate::parse("{{ eos_token }}|{{ messages[0].role }}|{{ messages[0].content }}", "e")
                             .render(ordered_json::parse(
                                 R"({"eos_token": "<|im_end|>", "messages": [{"role": "user", "content": "x"}]})"));
  EXPECT_EQ(e.text, "<|im_end|>|user|x");
  EXPECT_EQ(flags(e), "00000000000000001");
}

TEST(ChatTemplate, ProvenanceFollowsStringOperations) {
  const ordered_json ctx =
      ordered_json::parse(R"({"messages": [{"role": "user", "content": "  Ab,cD  "}], "n": "lit"})");
  const RenderedText r = ChatTemplate::parse(
      "{% set c = messages[0].content %}[{{ c.strip().split(',')|join('+') }}]{{ c|trim|upper }}"
      "{{ c[2:4] ~ n }}{{ c|replace('b', '-') }}{{ messages|length }}", "p").render(ctx);
  EXPECT_EQ(r.text, "[Ab+cD]AB,CDAblit  A-,cD  1");
  EXPECT_EQ(flags(r), std::string("0110110") + "11111" + "11000" + "111011111" + "1");
}

TEST(ChatTemplate, GenerationSpans) {
  const ChatTemplate t = ChatTemplate::parse(
      "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
      "</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}", "g.jinja");
  EXPECT_TRUE(t.has_generation_blocks());
  EXPECT_FALSE(ChatTemplate::parse("{{ x }}", "n").has_generation_blocks());
  const RenderedText r = t.render(ordered_json::parse(R"({"messages": [
      {"role": "user", "content": "é"}, {"role": "assistant", "content": "中文"},
      {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})"));
  // trim_blocks eats the newline after {% endif %}.
  EXPECT_EQ(r.text, "<user>é<assistant>中文</s><user>q<assistant></s>");
  const std::vector<std::pair<int64_t, int64_t>> want = {{19, 29}, {47, 51}};
  EXPECT_EQ(r.generation, want);
  EXPECT_EQ(r.text.substr(19, 10), "中文</s>");
}

// transformers' tracker is inactive until something has been yielded at the top level or a span
// recorded: a span that opens the text is not recorded, one after an empty print is.
TEST(ChatTemplate, GenerationSpansAsTransformersTracksThem) {
  auto spans = [](const char* source) {
    return ChatTemplate::parse(source, "g").render(ordered_json::object()).generation;
  };
  using Spans = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(spans("{% generation %}a{% endgeneration %}b{% generation %}c{% endgeneration %}"), (Spans{{2, 3}}));
  EXPECT_EQ(spans("{{ '' }}{% generation %}a{% endgeneration %}"), (Spans{{0, 1}}));
  EXPECT_EQ(spans("{% set x %}q{% endset %}{% generation %}a{% endgeneration %}{% generation %}b{% endgeneration %}"),
            (Spans{{1, 2}}));
  EXPECT_EQ(spans("x{% macro m() %}y{% endmacro %}{% generation %}{{ m() }}{% endgeneration %}"), (Spans{{1, 2}}));
}

TEST(ChatTemplate, HashIsTheSourcesSha256) {
  const ChatTemplate a = ChatTemplate::parse("{{ x }}", "a"), b = ChatTemplate::parse("{{ x }}", "b"),
                     c = ChatTemplate::parse("{{ y }}", "c");
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_NE(a.hash(), c.hash());
  EXPECT_EQ(a.hash().size(), 64u);
}

// strftime_now reads the day a render is given (GPT-OSS's "Current date: " in a golden), else the
// local clock, as transformers' datetime.now() does.
TEST(ChatTemplate, StrftimeNowReadsTheGivenDayOrTheClock) {
  const ChatTemplate t = ChatTemplate::parse("Current date: {{ strftime_now('%Y-%m-%d') }} {{ strftime_now('%d %b %Y') }}", "d");
  std::tm day{};
  day.tm_year = 2025 - 1900;
  day.tm_mon = 7;
  day.tm_mday = 5;
  day.tm_hour = 12;
  EXPECT_EQ(t.render(ordered_json::object(), &day).text, "Current date: 2025-08-05 05 Aug 2025");
  auto today = [] {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[64];
    return std::string(buf, std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm));
  };
  const std::string before = today();
  const std::string got = ChatTemplate::parse("{{ strftime_now('%Y-%m-%d') }}", "d").render(ordered_json::object()).text;
  const std::string after = today();
  EXPECT_TRUE(got == before || got == after) << got;
}

// Not a timed test: prints how long a conversation of about 4 MB takes, for the record.
TEST(ChatTemplate, RendersALargeConversation) {
  ordered_json msgs = ordered_json::array();
  std::string chunk;
  for (int k = 0; k < 2000; ++k) chunk += "word " + std::to_string(k) + " 中文 ";
  for (int k = 0; k < 64; ++k) {
    msgs.push_back({{"role", "user"}, {"content", chunk}});
    msgs.push_back({{"role", "assistant"}, {"content", "<think>\nthinking " + std::to_string(k) + "\n</think>\n\n" + chunk}});
  }
  const ChatTemplate t =
      ChatTemplate::parse(test::read_file(fixtures() + "templates/qwen3.jinja"), "qwen3.jinja");
  ordered_json ctx = {{"messages", msgs}, {"add_generation_prompt", false}};
  const auto t0 = std::chrono::steady_clock::now();
  const RenderedText r = t.render(ctx);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(r.text.size(), 4'000'000u);
  EXPECT_EQ(r.from_data.size(), r.text.size());
  std::cout << "rendered " << r.text.size() << " bytes (" << msgs.size() << " messages) in " << s << " s\n";
}

}  // namespace
}  // namespace lcx

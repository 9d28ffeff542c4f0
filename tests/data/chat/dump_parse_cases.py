"""Write parse_cases.json: the cases of llama.cpp's own chat-parser tests, as data.

``tests/test-chat.cpp`` of the pinned llama.cpp tree checks, for each model family, that a model's
output parses to the expected message (content, reasoning, tool calls), whole and streamed. Each
case is a ``peg_tester(...).test(input)...expect(...).run()``. This script compiles a copy of that
file whose ``run()`` also writes its case as a JSON line (the template, the request inputs, the
output and the expected message), runs it (so every case written also passed in llama.cpp's own
harness), and collects the lines. Run once, beside a llama.cpp build of the same tag in which
llama-server was built (it links llama-common and server-context), and commit the file:

    python tests/data/chat/dump_parse_cases.py --build BUILD_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chat_cases import DATA, llama_cpp_dir  # noqa: E402

DUMP = r'''
static void aiollama_dump_case(const std::string & path, const peg_test_case & tc) {
    static std::ofstream out(getenv("CHAT_CASES_OUT"), std::ios::app);
    const auto & p = tc.params;
    json j = json::object();
    j["template"] = path.substr(path.rfind('/') + 1);
    j["input"] = tc.input;
    j["is_partial"] = tc.is_partial;
    j["messages"] = common_chat_msgs_to_json_oaicompat(p.messages.empty() ? std::vector<common_chat_msg>{ message_user }
                                                                          : p.messages);
    if (!p.tools.empty()) {
        j["tools"] = common_chat_tools_to_json_oaicompat(p.tools);
    }
    j["tool_choice"] = p.tool_choice == COMMON_CHAT_TOOL_CHOICE_AUTO ? "auto" :
                       p.tool_choice == COMMON_CHAT_TOOL_CHOICE_NONE ? "none" : "required";
    j["parallel_tool_calls"] = p.parallel_tool_calls;
    j["reasoning_format"] = common_reasoning_format_name(p.reasoning_format);
    j["enable_thinking"] = p.enable_thinking;
    j["add_generation_prompt"] = p.add_generation_prompt;
    switch (p.continue_final_message) {
        case COMMON_CHAT_CONTINUATION_NONE: j["continue_final_message"] = false; break;
        case COMMON_CHAT_CONTINUATION_AUTO: j["continue_final_message"] = true; break;
        case COMMON_CHAT_CONTINUATION_REASONING: j["continue_final_message"] = "reasoning_content"; break;
        case COMMON_CHAT_CONTINUATION_CONTENT: j["continue_final_message"] = "content"; break;
    }
    if (!p.json_schema.empty()) {
        j["json_schema"] = json::parse(p.json_schema);
    }
    json kwargs = json::object();
    for (const auto & [k, v] : p.chat_template_kwargs) {
        kwargs[k] = json::parse(v);
    }
    j["chat_template_kwargs"] = kwargs;
    json expect = json::object();
    expect["content"] = tc.expect.content;
    expect["reasoning_content"] = tc.expect.reasoning_content;
    json calls = json::array();
    for (const auto & c : tc.expect.tool_calls) {
        json call = json::object();
        call["name"] = c.name;
        call["arguments"] = c.arguments;
        call["id"] = c.id;
        calls.push_back(call);
    }
    expect["tool_calls"] = calls;
    j["expect"] = expect;
    out << j.dump() << "\n";
    out.flush();
}

'''


def patched(source: str) -> str:
    anchor = "// Fluent builder for PEG parser tests"
    call = "        test_peg_parser(tester_.tmpls_.get(), [this](peg_test_case & t) { t = tc_; }, tester_.detailed_debug_);"
    if anchor not in source or call not in source:
        raise SystemExit("test-chat.cpp is not the shape this script knows")
    source = source.replace(anchor, DUMP + anchor, 1)
    return source.replace(call, call + "\n        aiollama_dump_case(tester_.template_path(), tc_);", 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", required=True, help="a llama.cpp build dir where llama-server was built")
    args = parser.parse_args()
    src, build = llama_cpp_dir(), Path(args.build).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        cpp = Path(tmp) / "test-chat-dump.cpp"
        cpp.write_text(patched((src / "tests" / "test-chat.cpp").read_text()))
        exe = Path(tmp) / "test-chat-dump"
        libs = [str(p) for p in sorted(build.rglob("*.a")) if p.name in ("libserver-context.a", "libcpp-httplib.a",
                                                                        "libllama-common-base.a", "libvendor-hash.a",
                                                                        "libllama-ui.a")]
        includes = [src / "common", src / "include", src / "ggml" / "include", src / "tools" / "server",
                    src / "tools" / "mtmd", src / "vendor", src / "tests", build / "common", build / "tools" / "server"]
        subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(cpp), *[f"-I{p}" for p in includes],
                        f"-L{build / 'bin'}", *libs, "-lllama-common", *libs, "-lmtmd", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{build / 'bin'}", "-lpthread"], check=True)
        out = Path(tmp) / "cases.jsonl"
        subprocess.run([str(exe)], cwd=src, check=True, env={**os.environ, "CHAT_CASES_OUT": str(out)},
                       stdout=subprocess.DEVNULL)
        cases = [json.loads(line) for line in out.read_text().splitlines()]
    (DATA / "parse_cases.json").write_text(json.dumps(cases, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    print(len(cases), "cases from", len({c["template"] for c in cases}), "templates")
    return 0


if __name__ == "__main__":
    sys.exit(main())

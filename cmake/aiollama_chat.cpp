// llama.cpp's chat layer (common/chat.h) behind the C interface of aiollama_chat.h: templates
// rendered and replies parsed exactly as llama-server does, with JSON across the boundary.

#include "aiollama_chat.h"

#include "chat.h"
#include "json.h"
#include "llama.h"
#include "peg-parser.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

using json = common_json;

struct aiollama_chat {
    common_chat_templates_ptr templates;
};

struct aiollama_chat_parser {
    common_chat_parser_params params;
};

static char * copy_string(const std::string & text) {
    char * out = static_cast<char *>(std::malloc(text.size() + 1));
    if (out != nullptr) {
        std::memcpy(out, text.c_str(), text.size() + 1);
    }
    return out;
}

static void set_error(char ** error, const char * message) {
    if (error != nullptr) {
        *error = copy_string(message);
    }
}

// Runs body, turning any exception into NULL and a message: no C++ exception crosses into C.
template <typename T, typename F> static T * guarded(char ** error, F body) {
    if (error != nullptr) {
        *error = nullptr;
    }
    try {
        return body();
    } catch (const std::exception & e) {
        set_error(error, e.what());
    } catch (...) {
        set_error(error, "unknown error in llama.cpp's chat layer");
    }
    return nullptr;
}

static const char * trigger_type_name(common_grammar_trigger_type type) {
    switch (type) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN: return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "unknown";
}

extern "C" struct aiollama_chat * aiollama_chat_init(const struct llama_model * model, const char * source,
                                                     const char * bos_token, const char * eos_token, char ** error) {
    return guarded<aiollama_chat>(error, [&]() -> aiollama_chat * {
        std::string src = source != nullptr ? source : "";
        if (model == nullptr && src.empty()) {
            throw std::invalid_argument("a chat template needs a model or a template text");
        }
        auto chat = new aiollama_chat();
        try {
            chat->templates = common_chat_templates_init(model, src, bos_token != nullptr ? bos_token : "",
                                                         eos_token != nullptr ? eos_token : "");
        } catch (...) {
            delete chat;
            throw;
        }
        return chat;
    });
}

extern "C" void aiollama_chat_free(struct aiollama_chat * chat) {
    delete chat;
}

extern "C" char * aiollama_chat_describe(const struct aiollama_chat * chat, char ** error) {
    return guarded<char>(error, [&]() -> char * {
        const auto * tmpls = chat->templates.get();
        json out = json::object();
        out["source"] = common_chat_templates_source(tmpls);
        out["tool_use_source"] = common_chat_templates_source(tmpls, "tool_use");
        out["explicit"] = common_chat_templates_was_explicit(tmpls);
        json caps = json::object();
        for (const auto & [name, value] : common_chat_templates_get_caps(tmpls)) {
            caps[name] = value;
        }
        out["caps"] = caps;
        out["supports_thinking"] = common_chat_templates_support_enable_thinking(tmpls);
        return copy_string(out.dump());
    });
}

extern "C" char * aiollama_chat_apply(const struct aiollama_chat * chat, const char * inputs_json, char ** error) {
    return guarded<char>(error, [&]() -> char * {
        const json body = json::parse(inputs_json);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(body.at("messages"));
        if (body.contains("tools")) {
            inputs.tools = common_chat_tools_parse_oaicompat(body.at("tools"));
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(body.value("tool_choice", std::string("auto")));
        if (body.contains("json_schema") && !body.at("json_schema").is_null()) {
            inputs.json_schema = body.at("json_schema").dump();
        }
        inputs.grammar = body.value("grammar", std::string());
        inputs.add_generation_prompt = body.value("add_generation_prompt", true);
        if (body.contains("continue_final_message")) {
            inputs.continue_final_message = common_chat_continuation_parse(body.at("continue_final_message"));
        }
        inputs.parallel_tool_calls = body.value("parallel_tool_calls", false);
        inputs.reasoning_format = common_reasoning_format_from_name(body.value("reasoning_format", std::string("auto")));
        inputs.enable_thinking = body.value("enable_thinking", true);
        if (body.contains("chat_template_kwargs")) {
            for (const auto & [name, value] : body.at("chat_template_kwargs").items()) {
                inputs.chat_template_kwargs[name] = value.dump();
            }
        }
        inputs.use_jinja = true;

        const common_chat_params params = common_chat_templates_apply(chat->templates.get(), inputs);
        json out = json::object();
        out["prompt"] = params.prompt;
        out["format"] = static_cast<int>(params.format);
        out["format_name"] = common_chat_format_name(params.format);
        out["grammar"] = params.grammar;
        out["grammar_lazy"] = params.grammar_lazy;
        json triggers = json::array();
        for (const auto & trigger : params.grammar_triggers) {
            json item = json::object();
            item["type"] = trigger_type_name(trigger.type);
            item["value"] = trigger.value;
            item["token"] = trigger.token;
            triggers.push_back(item);
        }
        out["grammar_triggers"] = triggers;
        out["preserved_tokens"] = params.preserved_tokens;
        out["additional_stops"] = params.additional_stops;
        out["generation_prompt"] = params.generation_prompt;
        out["supports_thinking"] = params.supports_thinking;
        out["thinking_start_tag"] = params.thinking_start_tag;
        out["thinking_end_tags"] = params.thinking_end_tags;
        out["parser"] = params.parser;
        return copy_string(out.dump());
    });
}

extern "C" struct aiollama_chat_parser * aiollama_chat_parser_init(const char * params_json, char ** error) {
    return guarded<aiollama_chat_parser>(error, [&]() -> aiollama_chat_parser * {
        const json body = json::parse(params_json);
        auto parser = new aiollama_chat_parser();
        try {
            auto & params = parser->params;
            params.format = static_cast<common_chat_format>(body.value("format", 0));
            if (params.format < COMMON_CHAT_FORMAT_CONTENT_ONLY || params.format >= COMMON_CHAT_FORMAT_COUNT) {
                throw std::invalid_argument("unknown chat format");
            }
            params.reasoning_format =
                common_reasoning_format_from_name(body.value("reasoning_format", std::string("auto")));
            params.reasoning_in_content = body.value("reasoning_in_content", false);
            params.generation_prompt = body.value("generation_prompt", std::string());
            params.parse_tool_calls = body.value("parse_tool_calls", true);
            params.is_continuation = body.value("is_continuation", false);
            const std::string arena = body.value("parser", std::string());
            if (!arena.empty()) {
                params.parser.load(arena);
            }
        } catch (...) {
            delete parser;
            throw;
        }
        return parser;
    });
}

extern "C" void aiollama_chat_parser_free(struct aiollama_chat_parser * parser) {
    delete parser;
}

extern "C" char * aiollama_chat_parse(const struct aiollama_chat_parser * parser, const char * text, size_t n_text,
                                      bool partial, char ** error) {
    return guarded<char>(error, [&]() -> char * {
        const common_chat_msg msg = common_chat_parse(std::string(text, n_text), partial, parser->params);
        json out = json::object();
        out["content"] = msg.content;
        out["reasoning_content"] = msg.reasoning_content;
        json calls = json::array();
        for (const auto & call : msg.tool_calls) {
            json item = json::object();
            item["name"] = call.name;
            item["arguments"] = call.arguments;
            item["id"] = call.id;
            calls.push_back(item);
        }
        out["tool_calls"] = calls;
        return copy_string(out.dump());
    });
}

extern "C" void aiollama_chat_string_free(char * text) {
    std::free(text);
}

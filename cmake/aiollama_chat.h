/* llama.cpp's chat layer (common/chat.h) behind a small C interface: JSON in, JSON out.
 *
 * Templates are rendered by llama.cpp's own Jinja engine with llama-server's request handling, and
 * replies are parsed by its own parsers (the per-family ones and the automatic one), so a model's
 * prompt, tool calls and reasoning come out as llama-server's do.
 *
 * Every char * these functions return belongs to the caller, who frees it with
 * aiollama_chat_string_free. A function that fails returns NULL (or nothing) and, where it takes
 * an error pointer, sets *error to a message the caller frees the same way. No C++ exception
 * leaves these functions.
 */

#ifndef AIOLLAMA_CHAT_H
#define AIOLLAMA_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct llama_context;
struct llama_batch_ext;
struct aiollama_chat;
struct aiollama_chat_parser;

/* The chat templates of a model (source NULL or empty: the GGUF's own, "tool_use" variant
 * included), or of the template text in source (model may then be NULL; bos_token and eos_token
 * are the texts it sees). */
struct aiollama_chat * aiollama_chat_init(const struct llama_model * model, const char * source,
                                          const char * bos_token, const char * eos_token, char ** error);
void aiollama_chat_free(struct aiollama_chat * chat);

/* {"source", "tool_use_source", "explicit", "caps": {...}, "supports_thinking"}. */
char * aiollama_chat_describe(const struct aiollama_chat * chat, char ** error);

/* Renders a request: inputs is {"messages", "tools", "tool_choice", "json_schema", "grammar",
 * "add_generation_prompt", "continue_final_message", "parallel_tool_calls", "reasoning_format",
 * "enable_thinking", "chat_template_kwargs", "now"}, with messages and tools in OpenAI's shapes.
 * Returns {"prompt", "format", "grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens",
 * "additional_stops", "generation_prompt", "supports_thinking", "thinking_start_tag",
 * "thinking_end_tags", "parser"}. */
char * aiollama_chat_apply(const struct aiollama_chat * chat, const char * inputs, char ** error);

/* A parser of replies: params is {"format", "parser", "generation_prompt", "reasoning_format",
 * "reasoning_in_content", "parse_tool_calls", "is_continuation"}, from a rendering's result. */
struct aiollama_chat_parser * aiollama_chat_parser_init(const char * params, char ** error);
void aiollama_chat_parser_free(struct aiollama_chat_parser * parser);

/* The message in a reply's text so far (partial: more may follow):
 * {"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}. */
char * aiollama_chat_parse(const struct aiollama_chat_parser * parser, const char * text, size_t n_text,
                           bool partial, char ** error);

void aiollama_chat_string_free(char * text);

/* What ctx holds per buffer type, as llama.cpp accounts it: for each of up to capacity buffer
 * types, its name and the bytes of the model's weights, the context's memory (KV cells,
 * recurrent states) and its compute buffers. Returns how many buffer types there are (-1 on an
 * error). With a model loaded with no_alloc, the sizes are what the allocations would take. */
int32_t aiollama_memory_breakdown(const struct llama_context * ctx, const char ** names, uint64_t * model,
                                  uint64_t * context, uint64_t * compute, int32_t capacity);

/* Multi-token prediction (cmake/nextn.cpp): whether ctx outputs the hidden states a model's NextN
 * layers read (masked: only for the batch entries that output logits, indexed as logits are;
 * otherwise for every entry, indexed by its place in the batch), and those states. */
void aiollama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
const float * aiollama_get_embeddings_nextn(struct llama_context * ctx);
const float * aiollama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);

/* Clears batch and adds n entries: token, position and sequence, the row of n_embd floats at
 * rows + i * n_embd as its state, logits where outputs says. Returns n, or what
 * llama_batch_ext_add_token returned for the entry it refused (< 0), or -4 for a refused row. */
int32_t aiollama_batch_ext_fill(struct llama_batch_ext * batch, int32_t n, const int32_t * tokens,
                                const int32_t * pos, const int32_t * seq_ids, const float * rows,
                                int32_t n_embd, const bool * outputs);

#ifdef __cplusplus
}
#endif

#endif

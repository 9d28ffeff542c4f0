// What a context holds per buffer type (llama.cpp's own accounting, src/llama-ext.h): the model's
// weights, the context's memory (KV cells, recurrent states) and its compute buffers. With a model
// loaded with no_alloc, the context simulates its allocations and reports what they would take: a
// plan before loading. A C entry point for the binding.

#include "aiollama_chat.h"

#include "ggml-backend.h"
#include "llama-ext.h"

extern "C" int32_t aiollama_memory_breakdown(const struct llama_context * ctx, const char ** names, uint64_t * model,
                                             uint64_t * context, uint64_t * compute, int32_t capacity) {
    try {
        const llama_memory_breakdown breakdown = llama_get_memory_breakdown(ctx);
        int32_t i = 0;
        for (const auto & [buft, data] : breakdown) {
            if (i < capacity) {
                names[i]   = ggml_backend_buft_name(buft);
                model[i]   = data.model;
                context[i] = data.context;
                compute[i] = data.compute;
            }
            i++;
        }
        return i;
    } catch (...) {
        return -1;
    }
}

// Multi-token prediction (MTP): llama.cpp's staging API for the hidden states a model's NextN
// layers read (src/llama-ext.h, C++ linkage), and one call that fills an extended batch with tokens
// paired with those states. C entry points for the binding.

#include "aiollama_chat.h"

#include "llama-ext.h"

extern "C" void aiollama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

extern "C" const float * aiollama_get_embeddings_nextn(struct llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

extern "C" const float * aiollama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

extern "C" int32_t aiollama_batch_ext_fill(struct llama_batch_ext * batch, int32_t n, const int32_t * tokens,
                                           const int32_t * pos, const int32_t * seq_ids, const float * rows,
                                           int32_t n_embd, const bool * outputs) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, seq_ids[i], tokens[i]);
        if (idx < 0) {
            return idx;
        }
        const llama_embd row = { rows + (size_t) i * n_embd, 1, (size_t) n_embd };
        if (!llama_batch_ext_set_pos(batch, idx, &pos[i]) || !llama_batch_ext_set_embd_token(batch, idx, row)) {
            return -4;
        }
        if (outputs[i] && !llama_batch_ext_set_output_logits(batch, idx, true)) {
            return -4;
        }
    }
    return n;
}

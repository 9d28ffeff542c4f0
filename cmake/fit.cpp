// llama.cpp's own fitting of a model to the free device memory (common/fit.cpp), for builds with a
// GPU backend, without the rest of llama.cpp's common library: this file gives fit.cpp the few
// logging functions it calls, forwarding warnings and errors to llama.cpp's log (and so to
// aiollama's), and a C entry point for the binding.

#include "fit.h"
#include "json.h"
#include "log.h"
#include "llama.h"

#include <cstdarg>
#include <cstdio>
#include <vector>

struct common_log {};

static common_log g_log;

int common_log_get_verbosity_thold(void) { return LOG_LEVEL_WARN; }
bool common_log_get_jsonl(void) { return false; }
struct common_log * common_log_main() { return &g_log; }
void common_log_add_json(struct common_log *, const char *, const common_json &) {}

void common_log_add(struct common_log *, enum ggml_log_level level, const char * fmt, ...) {
    ggml_log_callback callback = nullptr;
    void * user_data = nullptr;
    llama_log_get(&callback, &user_data);
    if (callback == nullptr) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    std::vector<char> text(512);
    va_list copy;
    va_copy(copy, args);
    int n = vsnprintf(text.data(), text.size(), fmt, copy);
    va_end(copy);
    if (n >= (int) text.size()) {
        text.resize(n + 1);
        vsnprintf(text.data(), text.size(), fmt, args);
    }
    va_end(args);
    if (n > 0) {
        callback(level, text.data(), user_data);
    }
}

// Fits mparams (n_gpu_layers, tensor_split, tensor_buft_overrides) and cparams to the free memory
// of the devices, leaving margin_bytes free on each. Returns 0 when a fit was found, 1 when none
// was, 2 on an error (the model could not be read). tensor_split must hold llama_max_devices()
// floats and overrides llama_max_tensor_buft_overrides() entries; mparams points at them after.
extern "C" int32_t aiollama_fit_impl(const char * path, struct llama_model_params * mparams,
                                     struct llama_context_params * cparams, float * tensor_split,
                                     struct llama_model_tensor_buft_override * overrides, size_t margin_bytes) {
    std::vector<size_t> margins(llama_max_devices(), margin_bytes);
    try {
        return (int32_t) common_fit_params(path, mparams, cparams, tensor_split, overrides, margins.data(),
                                           cparams->n_ctx, nullptr, GGML_LOG_LEVEL_ERROR);
    } catch (...) {
        return 2;
    }
}

// llama.cpp's own fitting of a model to the free device memory (common/fit.cpp), for builds with a
// GPU backend, without the rest of llama.cpp's common library (common_log.cpp gives it the logging
// functions it calls): a C entry point for the binding.

#include "fit.h"
#include "llama.h"

#include <vector>

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

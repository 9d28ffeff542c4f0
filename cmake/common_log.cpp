// The logging functions of llama.cpp's common library, for the parts of it that aiollama compiles
// (its chat layer, and its fitting on GPU builds) without the rest: warnings and errors go to
// llama.cpp's log callback, and so to aiollama's logger, instead of common's own logging thread.

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

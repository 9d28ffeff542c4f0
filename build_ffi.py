"""The cffi binding to llama.cpp: API mode, out of line.

``set_source`` makes the C compiler check every declaration below against ``llama.h``:

- a function whose signature drifted, or that the header lacks, fails to compile (the source turns
  incompatible pointer types and implicit declarations into errors);
- a field of another type, or a missing field or enum constant, fails to compile;
- a fully declared struct whose size or layout drifted fails when the module checks its types,
  which ``aiollama.native.binding`` does at import (``verify_declarations``);
- structs declared with ``...;`` and enums declared with ``...`` take their layout and values from
  the compiler, so only the names here need to exist.

The build runs ``python build_ffi.py --emit OUT.c`` and compiles OUT.c against llama.
``tests/test_binding.py`` compiles drifted copies of this cdef to prove each check bites.
"""

from __future__ import annotations

import sys

from cffi import FFI

MODULE = "aiollama._llama_cffi"

CDEF = r"""
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
struct llama_adapter_lora;
typedef struct llama_memory_i * llama_memory_t;

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
    GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ...
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);

enum llama_vocab_type {
    LLAMA_VOCAB_TYPE_NONE, LLAMA_VOCAB_TYPE_SPM, LLAMA_VOCAB_TYPE_BPE, LLAMA_VOCAB_TYPE_WPM,
    LLAMA_VOCAB_TYPE_UGM, LLAMA_VOCAB_TYPE_RWKV, LLAMA_VOCAB_TYPE_PLAMO2, LLAMA_VOCAB_TYPE_TEST, ...
};
enum llama_token_attr {
    LLAMA_TOKEN_ATTR_UNDEFINED, LLAMA_TOKEN_ATTR_UNKNOWN, LLAMA_TOKEN_ATTR_UNUSED, LLAMA_TOKEN_ATTR_NORMAL,
    LLAMA_TOKEN_ATTR_CONTROL, LLAMA_TOKEN_ATTR_USER_DEFINED, LLAMA_TOKEN_ATTR_BYTE,
    LLAMA_TOKEN_ATTR_NORMALIZED, LLAMA_TOKEN_ATTR_LSTRIP, LLAMA_TOKEN_ATTR_RSTRIP,
    LLAMA_TOKEN_ATTR_SINGLE_WORD, ...
};
enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, LLAMA_SPLIT_MODE_TENSOR, ...
};
enum llama_load_mode {
    LLAMA_LOAD_MODE_AUTO, LLAMA_LOAD_MODE_NONE, LLAMA_LOAD_MODE_MMAP, LLAMA_LOAD_MODE_MLOCK,
    LLAMA_LOAD_MODE_MMAP_MLOCK, LLAMA_LOAD_MODE_DIRECT_IO, ...
};
enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED, ...
};
enum ggml_type {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0, GGML_TYPE_BF16, ...
};
enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED, LLAMA_POOLING_TYPE_NONE, LLAMA_POOLING_TYPE_MEAN,
    LLAMA_POOLING_TYPE_CLS, LLAMA_POOLING_TYPE_LAST, LLAMA_POOLING_TYPE_RANK, ...
};

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
struct llama_model_tensor_buft_override {
    const char * pattern;
    ggml_backend_buffer_type_t buft;
};

struct llama_model_params {
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    enum llama_load_mode load_mode;
    int32_t main_gpu;
    const float * tensor_split;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_alloc;
    bool load_mtp;
    ...;
};

enum llama_context_type { LLAMA_CONTEXT_TYPE_DEFAULT, LLAMA_CONTEXT_TYPE_MTP, ... };
struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_context_type ctx_type;
    enum llama_pooling_type pooling_type;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    ggml_abort_callback abort_callback;
    void * abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool swa_full;
    bool kv_unified;
    ...;
};

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
};

struct llama_perf_sampler_data {
    double t_sample_ms;
    int32_t n_sample;
};

/* lifecycle and params */
const char * llama_version(void);
struct llama_model_params llama_model_default_params(void);

enum llama_ftype {
    LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16, LLAMA_FTYPE_MOSTLY_Q4_0, LLAMA_FTYPE_MOSTLY_Q4_1,
    LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_K_S, LLAMA_FTYPE_MOSTLY_Q4_K_M, ...
};
typedef struct llama_model_quantize_params {
    int32_t nthread;
    enum llama_ftype ftype;
    bool allow_requantize;
    bool quantize_output_tensor;
    bool pure;
    ...;
} llama_model_quantize_params;
llama_model_quantize_params llama_model_quantize_default_params(void);
uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out, const llama_model_quantize_params * params);
struct llama_context_params llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
void llama_backend_init(void);
void llama_backend_free(void);
size_t llama_max_parallel_sequences(void);
size_t llama_max_devices(void);
size_t llama_max_tensor_buft_overrides(void);
bool llama_supports_gpu_offload(void);
const char * llama_print_system_info(void);

/* model */
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
uint32_t llama_model_n_cls_out(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
enum llama_ftype llama_model_ftype(const struct llama_model * model);
const char * llama_ftype_name(enum llama_ftype ftype);
bool llama_model_has_encoder(const struct llama_model * model);
bool llama_model_has_decoder(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);

/* context */
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
struct llama_adapter_lora * llama_adapter_lora_init(struct llama_model * model, const char * path_lora);
void llama_adapter_lora_free(struct llama_adapter_lora * adapter);
int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters, size_t n_adapters,
                                float * scales);
uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
uint32_t llama_n_rs_seq(const struct llama_context * ctx);
const struct llama_model * llama_get_model(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_n_threads(struct llama_context * ctx);
int32_t llama_n_threads_batch(struct llama_context * ctx);
void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
void llama_synchronize(struct llama_context * ctx);

/* batch and decode */
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);
enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);

/* memory (KV cache) */
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);

/* per-sequence state */
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, uint32_t flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, uint32_t flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id, uint32_t flags);

/* vocab, tokenize, detokenize */
enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
enum llama_token_attr llama_vocab_get_attr(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_sep(const struct llama_vocab * vocab);
llama_token llama_vocab_nl(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_suf(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_mid(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_rep(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_sep(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_sep(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

/* chat template */
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
int32_t llama_chat_builtin_templates(const char ** output, size_t len);

/* sampling */
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_chain_get(struct llama_sampler * chain, int32_t i);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
const char * llama_sampler_name(const struct llama_sampler * smpl);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_reset(struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
uint32_t llama_sampler_get_seed(const struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
llama_token llama_get_sampled_token_ith(struct llama_context * ctx, int32_t i);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_typical(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_temp_ext(float t, float delta, float exponent);
struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str,
                                                  const char * grammar_root);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);

/* devices and backends (ggml) */
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL, ...
};
size_t ggml_backend_reg_count(void);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void ggml_backend_load_all_from_path(const char * dir_path);
const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);

/* images (libmtmd): a projector beside the text model turns a bitmap into embedding rows */
typedef struct mtmd_context mtmd_context;
typedef struct mtmd_bitmap mtmd_bitmap;
typedef struct mtmd_input_chunk mtmd_input_chunk;
typedef struct mtmd_input_chunks mtmd_input_chunks;
typedef struct mtmd_helper_video mtmd_helper_video;
enum mtmd_input_chunk_type {
    MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_AUDIO, ...
};
typedef struct mtmd_input_text {
    const char * text;
    size_t text_len;
    bool add_special;
    bool parse_special;
} mtmd_input_text;
struct mtmd_context_params {
    bool use_gpu;
    ggml_backend_dev_t device;
    bool print_timings;
    int n_threads;
    const char * media_marker;
    bool warmup;
    int image_min_tokens;
    int image_max_tokens;
    ...;
};
struct mtmd_helper_init_opt { ...; };
struct mtmd_helper_bitmap_wrapper {
    mtmd_bitmap * bitmap;
    mtmd_helper_video * video_ctx;
};
struct mtmd_context_params mtmd_context_params_default(void);
mtmd_context * mtmd_init_from_file(const char * mmproj_fname, const struct llama_model * text_model,
                                   const struct mtmd_context_params ctx_params);
void mtmd_free(mtmd_context * ctx);
bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
bool mtmd_decode_use_mrope(const mtmd_context * ctx);
bool mtmd_support_vision(const mtmd_context * ctx);
bool mtmd_support_audio(const mtmd_context * ctx);
void mtmd_bitmap_free(mtmd_bitmap * bitmap);
uint32_t mtmd_bitmap_get_nx(const mtmd_bitmap * bitmap);
uint32_t mtmd_bitmap_get_ny(const mtmd_bitmap * bitmap);
bool mtmd_bitmap_is_audio(const mtmd_bitmap * bitmap);
mtmd_input_chunks * mtmd_input_chunks_init(void);
size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
void mtmd_input_chunks_free(mtmd_input_chunks * chunks);
enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk, size_t * n_tokens_output);
size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output, const mtmd_input_text * text,
                      const mtmd_bitmap * const * bitmaps, size_t n_bitmaps);
int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);
float * mtmd_get_output_embd(mtmd_context * ctx);
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
int32_t mtmd_helper_eval_chunks(mtmd_context * ctx, struct llama_context * lctx, const mtmd_input_chunks * chunks,
                                llama_pos n_past, llama_seq_id seq_id, int32_t n_batch, bool logits_last,
                                llama_pos * new_n_past);
struct mtmd_helper_init_opt mtmd_helper_init_opt_default(void);
struct mtmd_helper_bitmap_wrapper mtmd_helper_bitmap_init_from_buf(const mtmd_context * ctx, const unsigned char * buf,
                                                                   size_t len, bool placeholder,
                                                                   struct mtmd_helper_init_opt opt);

/* logging and perf */
void llama_log_set(ggml_log_callback log_callback, void * user_data);
struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void llama_perf_context_reset(struct llama_context * ctx);
struct llama_perf_sampler_data llama_perf_sampler(const struct llama_sampler * chain);

/* llama.cpp's chat layer, through the shim in cmake/aiollama_chat.h (JSON in, JSON out) */
struct aiollama_chat;
struct aiollama_chat_parser;
struct aiollama_chat * aiollama_chat_init(const struct llama_model * model, const char * source,
                                          const char * bos_token, const char * eos_token, char ** error);
void aiollama_chat_free(struct aiollama_chat * chat);
char * aiollama_chat_describe(const struct aiollama_chat * chat, char ** error);
char * aiollama_chat_apply(const struct aiollama_chat * chat, const char * inputs, char ** error);
struct aiollama_chat_parser * aiollama_chat_parser_init(const char * params, char ** error);
void aiollama_chat_parser_free(struct aiollama_chat_parser * parser);
char * aiollama_chat_parse(const struct aiollama_chat_parser * parser, const char * text, size_t n_text,
                           bool partial, char ** error);
void aiollama_chat_string_free(char * text);
int32_t aiollama_memory_breakdown(const struct llama_context * ctx, const char ** names, uint64_t * model,
                                  uint64_t * context, uint64_t * compute, int32_t capacity);

/* multi-token prediction: the extended batch, and the hidden states the NextN layers read (the
   shim in cmake/nextn.cpp) */
enum llama_process_type { LLAMA_PROCESS_TYPE_ENCODE, LLAMA_PROCESS_TYPE_DECODE, ... };
struct llama_batch_ext;
struct llama_batch_ext * llama_batch_ext_init(struct llama_context * ctx);
void llama_batch_ext_free(struct llama_batch_ext * batch);
int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch);
int32_t llama_model_n_layer_nextn(const struct llama_model * model);
int32_t llama_model_n_embd_out(const struct llama_model * model);
void aiollama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
const float * aiollama_get_embeddings_nextn(struct llama_context * ctx);
const float * aiollama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
int32_t aiollama_batch_ext_fill(struct llama_batch_ext * batch, int32_t n, const int32_t * tokens,
                                const int32_t * pos, const int32_t * seq_ids, const float * rows,
                                int32_t n_embd, const bool * outputs);

/* helpers compiled into this module (see HELPERS) */
bool aiollama_abort_cb(void * data);
void aiollama_flag_store(int * flag, int value);
int aiollama_flag_load(int * flag);
int32_t aiollama_extra_bufts(const char ** names, int32_t max);
int32_t aiollama_fit(const char * path, struct llama_model_params * mparams, struct llama_context_params * cparams,
                     float * tensor_split, struct llama_model_tensor_buft_override * overrides, size_t margin_bytes);
void aiollama_log_install(int min_level);
int32_t aiollama_reference_kernels(struct llama_context * ctx, bool on);
void aiollama_sample_rows(struct llama_context * ctx, struct llama_sampler ** chains, const int32_t * rows,
                          const int32_t * top_k, int32_t n, int32_t n_threads, int32_t * out);
extern "Python" void aiollama_log_py(int level, const char * text);
"""

# The abort callback runs after every graph node on the decoding thread, so it stays in C: it reads
# an int that Python sets atomically. The log trampoline drops messages under the chosen level
# in C, so llama.cpp's debug chatter never has to take the GIL.
HELPERS = r"""
/* A declaration that drifted from llama.h must fail the build, not warn. */
#pragma GCC diagnostic error "-Wincompatible-pointer-types"
#pragma GCC diagnostic error "-Wint-conversion"
#pragma GCC diagnostic error "-Wimplicit-function-declaration"

#include <pthread.h>
#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"
#include "aiollama_chat.h"

/* ggml-cpu's reference kernels for every CPU backend of a context (or back to the fast ones).
 * They compute each output row the same way whatever the batch holds: no llamafile sgemm or tiled
 * matrix products chosen by batch width, no tiled or KV-split flash attention, no fused ops.
 * llama.h has no way to reach a context's backends; llama_context::get_sched() (exported by
 * libllama, a plain member function: `this` is its first argument in the Itanium C++ ABI) does.
 * Returns the number of CPU backends set, or -1 where this cannot be done. */
#if defined(__GNUC__) && !defined(_WIN32)
ggml_backend_sched_t _ZNK13llama_context9get_schedEv(const struct llama_context * ctx);
#define AIOLLAMA_HAS_SCHED 1
#endif

static int32_t aiollama_reference_kernels(struct llama_context * ctx, bool on) {
#if defined(AIOLLAMA_HAS_SCHED)
    ggml_backend_sched_t sched = _ZNK13llama_context9get_schedEv(ctx);
    int32_t n = 0;
    if (sched == NULL) {
        return -1;
    }
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev == NULL || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        void (*set_use_ref)(ggml_backend_t, bool) = (void (*)(ggml_backend_t, bool))
            ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_cpu_set_use_ref");
        if (set_use_ref == NULL) {
            return -1;
        }
        set_use_ref(backend, on);
        n++;
    }
    return n;
#else
    (void) ctx;
    (void) on;
    return -1;
#endif
}

static bool aiollama_abort_cb(void * data) {
    return __atomic_load_n((int *) data, __ATOMIC_ACQUIRE) != 0;
}

static void aiollama_flag_store(int * flag, int value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

static int aiollama_flag_load(int * flag) {
    return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
}

static void aiollama_log_py(int level, const char * text);

static int aiollama_log_min_level = GGML_LOG_LEVEL_WARN;
static int aiollama_log_last_level = GGML_LOG_LEVEL_NONE;

static void aiollama_log_trampoline(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    int effective = (level == GGML_LOG_LEVEL_CONT) ? aiollama_log_last_level : (int) level;
    aiollama_log_last_level = effective;
    if (effective >= aiollama_log_min_level && text != NULL) {
        aiollama_log_py(effective, text);
    }
}

/* The names of the extra buffer types the CPU backend offers for weights (repacked layouts, AMX
   tiles...: what llama_model_params.use_extra_bufts enables); returns how many, at most max. */
static int32_t aiollama_extra_bufts(const char ** names, int32_t max) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == NULL) {
        return 0;
    }
    ggml_backend_dev_get_extra_bufts_t get = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    int32_t n = 0;
    for (ggml_backend_buffer_type_t * b = get != NULL ? get(cpu) : NULL; b != NULL && *b != NULL; ++b) {
        if (n < max) {
            names[n] = ggml_backend_buft_name(*b);
        }
        ++n;
    }
    return n;
}

/* llama.cpp's fitting of a model to the free device memory, where the build has a GPU backend
   (cmake/fit.cpp); -1 where it has none. */
#if defined(AIOLLAMA_HAVE_FIT)
int32_t aiollama_fit_impl(const char * path, struct llama_model_params * mparams, struct llama_context_params * cparams,
                          float * tensor_split, struct llama_model_tensor_buft_override * overrides, size_t margin_bytes);
#endif
static int32_t aiollama_fit(const char * path, struct llama_model_params * mparams, struct llama_context_params * cparams,
                            float * tensor_split, struct llama_model_tensor_buft_override * overrides, size_t margin_bytes) {
#if defined(AIOLLAMA_HAVE_FIT)
    return aiollama_fit_impl(path, mparams, cparams, tensor_split, overrides, margin_bytes);
#else
    (void) path; (void) mparams; (void) cparams; (void) tensor_split; (void) overrides; (void) margin_bytes;
    return -1;
#endif
}

static void aiollama_log_install(int min_level) {
    aiollama_log_min_level = min_level;
    llama_log_set(aiollama_log_trampoline, NULL);
    mtmd_log_set(aiollama_log_trampoline, NULL);
    mtmd_helper_log_set(aiollama_log_trampoline, NULL);
}

#define AIOLLAMA_BLOCK 64

/* The largest of each of the first n_blocks blocks of 64 logits, into maxima; 0 if the row holds
   a NaN (the maxima are then of no use). One pass over the row, four at a time with SSE2. */
static int aiollama_block_maxima(const float * logits, int32_t n_blocks, float * maxima) {
#if defined(__SSE2__)
    __m128 nan = _mm_setzero_ps();
    for (int32_t blk = 0; blk < n_blocks; ++blk) {
        const float * x = logits + (size_t) blk * AIOLLAMA_BLOCK;
        __m128 a = _mm_loadu_ps(x), b = _mm_loadu_ps(x + 4), c = _mm_loadu_ps(x + 8), d = _mm_loadu_ps(x + 12);
        nan = _mm_or_ps(nan, _mm_or_ps(_mm_cmpunord_ps(a, b), _mm_cmpunord_ps(c, d)));
        for (int i = 16; i < AIOLLAMA_BLOCK; i += 16) {
            const __m128 e = _mm_loadu_ps(x + i), f = _mm_loadu_ps(x + i + 4);
            const __m128 g = _mm_loadu_ps(x + i + 8), h = _mm_loadu_ps(x + i + 12);
            nan = _mm_or_ps(nan, _mm_or_ps(_mm_cmpunord_ps(e, f), _mm_cmpunord_ps(g, h)));
            a = _mm_max_ps(a, e);
            b = _mm_max_ps(b, f);
            c = _mm_max_ps(c, g);
            d = _mm_max_ps(d, h);
        }
        __m128 m = _mm_max_ps(_mm_max_ps(a, b), _mm_max_ps(c, d));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
        maxima[blk] = _mm_cvtss_f32(m);
    }
    return _mm_movemask_ps(nan) == 0;
#else
    for (int32_t blk = 0; blk < n_blocks; ++blk) {
        const float * x = logits + (size_t) blk * AIOLLAMA_BLOCK;
        float m = x[0];
        for (int i = 0; i < AIOLLAMA_BLOCK; ++i) {
            if (x[i] != x[i]) {
                return 0;
            }
            m = x[i] > m ? x[i] : m;
        }
        maxima[blk] = m;
    }
    return 1;
#endif
}

/* The k-th largest of n values (k <= n, k <= AIOLLAMA_CUTOFF_MAX; no NaN among them). */
#define AIOLLAMA_CUTOFF_MAX 256
static float aiollama_kth_largest(const float * values, int32_t n, int32_t k) {
    float top[AIOLLAMA_CUTOFF_MAX];
    int32_t m = 0;
    for (int32_t i = 0; i < n; ++i) {
        const float x = values[i];
        if (m == k && !(x > top[k - 1])) {
            continue;
        }
        int32_t j = m < k ? m++ : k - 1;
        while (j > 0 && top[j - 1] < x) {
            top[j] = top[j - 1];
            --j;
        }
        top[j] = x;
    }
    return top[k - 1];
}

/* The K largest logits of a row, largest first (ties: lower id first), into out[0..K): the
   candidates a chain that starts with top-k (or greedy, K = 1) keeps anyway, found without
   building and sorting an array of the whole vocabulary. One pass first takes each block of 64's
   largest into maxima (room for a float per whole block): the K-th largest of those is a cutoff
   that the K-th largest logit reaches (the K blocks' largest are K logits at or above it), so a
   block whose largest is below it holds none of the K and is passed over, as is one whose largest
   is not above the K-th held once K are. The blocks left are read in order, value by value: the
   same K, in the same order, as reading every block. -1 for a row with a NaN, which has no K
   largest (the caller builds the whole row, as llama.cpp does). */
static int32_t aiollama_top_k(const float * logits, int32_t n_vocab, int32_t k, llama_token_data * out,
                              float * maxima) {
    const int32_t n_blocks = n_vocab / AIOLLAMA_BLOCK;
    if (!aiollama_block_maxima(logits, n_blocks, maxima)) {
        return -1;
    }
    for (int32_t id = n_blocks * AIOLLAMA_BLOCK; id < n_vocab; ++id) {
        if (logits[id] != logits[id]) {  /* a partial last block has no maximum: its NaN is looked for here */
            return -1;
        }
    }
    const int cut = k <= n_blocks && k <= AIOLLAMA_CUTOFF_MAX;
    const float cutoff = cut ? aiollama_kth_largest(maxima, n_blocks, k) : 0.0f;
    int32_t m = 0;
    for (int32_t start = 0; start < n_vocab; start += AIOLLAMA_BLOCK) {
        const int32_t end = start + AIOLLAMA_BLOCK <= n_vocab ? start + AIOLLAMA_BLOCK : n_vocab;
        if (end - start == AIOLLAMA_BLOCK) {
            const float top = maxima[start / AIOLLAMA_BLOCK];
            if ((cut && top < cutoff) || (m == k && top <= out[k - 1].logit)) {
                continue;
            }
        }
        for (int32_t id = start; id < end; ++id) {
            const float x = logits[id];
            if (m == k && !(x > out[k - 1].logit)) {
                continue;
            }
            int32_t j = m < k ? m++ : k - 1;
            while (j > 0 && out[j - 1].logit < x) {
                out[j] = out[j - 1];
                --j;
            }
            out[j].id = id;
            out[j].logit = x;
            out[j].p = 0.0f;
        }
    }
    return m;
}

/* Each thread's scratch memory (the candidates, and the block maxima after them), kept between
   calls and freed when the thread ends. */
struct aiollama_scratch { size_t size; double data[]; };
static pthread_key_t aiollama_scratch_key;
static pthread_once_t aiollama_scratch_once = PTHREAD_ONCE_INIT;

static void aiollama_scratch_init(void) {
    (void) pthread_key_create(&aiollama_scratch_key, free);
}

static void * aiollama_scratch(size_t bytes) {
    (void) pthread_once(&aiollama_scratch_once, aiollama_scratch_init);
    struct aiollama_scratch * s = (struct aiollama_scratch *) pthread_getspecific(aiollama_scratch_key);
    if (s == NULL || s->size < bytes) {
        struct aiollama_scratch * grown = (struct aiollama_scratch *) realloc(s, sizeof(struct aiollama_scratch) + bytes);
        if (grown == NULL) {
            return NULL;
        }
        grown->size = bytes;
        s = grown;
        (void) pthread_setspecific(aiollama_scratch_key, s);
    }
    return s->data;
}

/* Choose (and accept) one row's token with its chain, as llama_sampler_sample does. With top_k > 0
   (the chain starts with top-k of that k, or is greedy and k is 1, with nothing before that reads
   the whole row), only the k best candidates are built, sorted: the chain's top-k then keeps them
   all, and what follows sees what it would have seen. -1 if memory ran out. */
static llama_token aiollama_sample_one(struct llama_sampler * chain, const float * logits, int32_t n_vocab,
                                       int32_t top_k) {
    const int32_t n = top_k > 0 && top_k < n_vocab ? top_k : n_vocab;
    const size_t n_blocks = n < n_vocab ? (size_t) (n_vocab / AIOLLAMA_BLOCK) : 0;
    llama_token_data * cur = (llama_token_data *) aiollama_scratch(
        (size_t) n * sizeof(llama_token_data) + n_blocks * sizeof(float));
    if (cur == NULL) {
        return -1;
    }
    llama_token_data_array cur_p = { cur, (size_t) n, -1, false };
    const int32_t best = n < n_vocab ? aiollama_top_k(logits, n_vocab, n, cur, (float *) (cur + n)) : -1;
    if (best >= 0) {
        cur_p.size = (size_t) best;
        cur_p.sorted = true;
    } else {
        if (n < n_vocab) {  /* a row with a NaN: built whole, as without the fast path */
            cur = (llama_token_data *) aiollama_scratch((size_t) n_vocab * sizeof(llama_token_data));
            if (cur == NULL) {
                return -1;
            }
            cur_p.data = cur;
            cur_p.size = (size_t) n_vocab;
        }
        for (int32_t id = 0; id < n_vocab; ++id) {
            cur[id].id = id;
            cur[id].logit = logits[id];
            cur[id].p = 0.0f;
        }
    }
    llama_sampler_apply(chain, &cur_p);
    if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size) {
        return -1;
    }
    const llama_token token = cur_p.data[cur_p.selected].id;
    llama_sampler_accept(chain, token);
    return token;
}

/* One decode's sampling in one call: chains[i] chooses (and accepts) a token from output row
   rows[i]; top_k[i] as above (NULL: 0 for every row). A row a backend sampler already chose (the
   chain is attached to its sequence, see llama_set_sampler) is only read. The rows' logits are located here first, on
   this thread (which synchronizes the context and applies any reordering of its outputs); after
   that the work only reads the context, and the chains are distinct objects, so the rows are
   shared out over the threads the decode used and has just left idle. Without OpenMP they run in
   turn. out[i] is -1 where a row could not be sampled. */
static void aiollama_sample_rows(struct llama_context * ctx, struct llama_sampler ** chains, const int32_t * rows,
                                 const int32_t * top_k, int32_t n, int32_t n_threads, int32_t * out) {
    if (n <= 0) {
        return;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const float ** logits = (const float **) malloc((size_t) n * sizeof(float *));
    if (logits == NULL) {
        for (int32_t i = 0; i < n; ++i) {
            out[i] = -1;
        }
        return;
    }
    for (int32_t i = 0; i < n; ++i) {
        /* a row a backend sampler chose in the graph: the chain takes (and accepts) that token */
        if (llama_get_sampled_token_ith(ctx, rows[i]) != LLAMA_TOKEN_NULL) {
            out[i] = llama_sampler_sample(chains[i], ctx, rows[i]);
            logits[i] = NULL;
            continue;
        }
        out[i] = -2;
        logits[i] = llama_get_logits_ith(ctx, rows[i]);
    }
#if defined(_OPENMP)
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1 && n >= 4)
#endif
    for (int32_t i = 0; i < n; ++i) {
        if (out[i] == -2) {
            out[i] = logits[i] == NULL ? -1 : aiollama_sample_one(chains[i], logits[i], n_vocab, top_k ? top_k[i] : 0);
        }
    }
    free((void *) logits);
    (void) n_threads;
}
"""


def make_builder(cdef: str = CDEF, **source_kwargs: object) -> FFI:
    """An FFI builder for ``cdef``; ``source_kwargs`` go to ``set_source`` (include_dirs...)."""
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(MODULE, HELPERS, **source_kwargs)
    return builder


ffibuilder = make_builder()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--emit":
        ffibuilder.emit_c_code(argv[1])
        return 0
    print("usage: python build_ffi.py --emit OUT.c", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

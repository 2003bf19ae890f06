// llamacpp-greedy: reference data generator for handoff.
//
// Built by scripts/build-llamacpp.sh against the pinned llama.cpp (static
// libllama + ggml).  Uses only the public llama.h API (modelled on
// examples/simple/simple.cpp) and llama.cpp's vendored nlohmann/json.
//
// Usage:
//   llamacpp-greedy generate -m MODEL -f PROMPTS.jsonl [-n 48] [-t 2] [-c 2048] [--fa auto|on|off]
//                            [--extra-bufts 0|1]   (default 0: no AMX/repack buffers, see below)
//   llamacpp-greedy tokenize -m MODEL -f STRINGS.jsonl
//
// Input: JSON lines, one object per line: {"name": "...", "prompt": "..."}
// (tokenize mode also accepts {"text": "..."}; "name" is optional there).
// generate also reads an optional per-line "add_special" (default true): false
// for prompts that already start with the BOS text (e.g. a chat template that
// renders `<bos>` itself, on a GGUF with add_bos_token=true), so that BOS is
// not doubled. The value used is echoed per case.
// generate also accepts an optional per-line "prompt_ids" (array of token
// ids): then those ids are the prompt as they are (no tokenization, nothing
// added) and "prompt" may be left out (e.g. random-token prompts for the
// seeded test models of crates/handoff-testmodels).
// Output: one JSON document on stdout; logs go to stderr.
//
// generate: for every prompt, tokenizes it with
//   llama_tokenize(vocab, prompt, add_special=true, parse_special=true)
// (add_special=true means "add BOS/EOS if the GGUF says so"; SmolLM2 has
// tokenizer.ggml.add_bos_token=false so nothing is added), decodes the whole
// prompt as one batch in a fresh context, then greedily (argmax over the raw
// logits, lowest id on ties) generates up to N tokens one at a time, stopping
// early only when the argmax is an end-of-generation token
// (llama_vocab_is_eog; for SmolLM2 that is id 2 <|im_end|>; the EOG token is
// included in output_ids).
//
// tokenize: for every string, ids with parse_special=true and =false (both
// with add_special=false, i.e. no BOS), plus the ids with add_special=true.

#include "llama.h"
#include "nlohmann/json.hpp"

#include <algorithm>
#include <clocale>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static constexpr int TOP_K = 5;  // logits recorded per generated token

static void usage(const char * argv0) {
    fprintf(stderr,
            "usage:\n"
            "  %s generate -m MODEL -f PROMPTS.jsonl [-n 48] [-t 2] [-c 2048] [--fa auto|on|off] [--extra-bufts 0|1]\n"
            "  %s tokenize -m MODEL -f STRINGS.jsonl\n",
            argv0, argv0);
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool add_special,
                                         bool parse_special) {
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), nullptr, 0, add_special, parse_special);
    if (n == INT32_MIN) {
        fprintf(stderr, "error: tokenization overflow\n");
        exit(1);
    }
    n = n < 0 ? -n : n;
    std::vector<llama_token> out(n);
    if (n > 0) {
        const int32_t m = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), n, add_special,
                                         parse_special);
        if (m < 0) {
            fprintf(stderr, "error: tokenization failed\n");
            exit(1);
        }
        out.resize(m);
    }
    return out;
}

static std::string piece(const llama_vocab * vocab, llama_token id) {
    std::vector<char> buf(256);
    int32_t n = llama_token_to_piece(vocab, id, buf.data(), (int32_t) buf.size(), 0, /*special=*/true);
    if (n < 0) {
        buf.resize(-n);
        n = llama_token_to_piece(vocab, id, buf.data(), (int32_t) buf.size(), 0, true);
    }
    if (n < 0) {
        fprintf(stderr, "error: token_to_piece failed for %d\n", id);
        exit(1);
    }
    return std::string(buf.data(), n);
}

static std::string detok(const llama_vocab * vocab, const std::vector<llama_token> & ids) {
    if (ids.empty()) {
        return "";
    }
    std::vector<char> buf(ids.size() * 32 + 64);
    int32_t n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), buf.data(), (int32_t) buf.size(),
                                 /*remove_special=*/false, /*unparse_special=*/true);
    if (n < 0) {
        buf.resize(-n);
        n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), buf.data(), (int32_t) buf.size(), false, true);
    }
    if (n < 0) {
        fprintf(stderr, "error: detokenize failed\n");
        exit(1);
    }
    return std::string(buf.data(), n);
}

static bool valid_utf8(const std::string & s) {
    size_t i = 0;
    const size_t n = s.size();
    while (i < n) {
        const unsigned char c = s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (len == 0 || i + len > n) return false;
        for (int k = 1; k < len; k++) {
            if ((((unsigned char) s[i + k]) >> 6) != 0x2) return false;
        }
        i += len;
    }
    return true;
}

static std::string to_hex(const std::string & s) {
    static const char * d = "0123456789abcdef";
    std::string out;
    for (unsigned char c : s) {
        out.push_back(d[c >> 4]);
        out.push_back(d[c & 15]);
    }
    return out;
}

static std::vector<json> read_jsonl(const std::string & path) {
    std::ifstream in(path);
    if (!in) {
        fprintf(stderr, "error: cannot open %s\n", path.c_str());
        exit(1);
    }
    std::vector<json> out;
    std::string line;
    while (std::getline(in, line)) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) {
            continue;
        }
        out.push_back(json::parse(line));
    }
    return out;
}

static std::string model_meta(const llama_model * model, const char * key) {
    std::vector<char> buf(1 << 16);
    int32_t n = llama_model_meta_val_str(model, key, buf.data(), buf.size());
    if (n < 0) {
        return "";
    }
    return std::string(buf.data(), std::min<size_t>(n, buf.size() - 1));
}

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc < 2) {
        usage(argv[0]);
        return 1;
    }
    const std::string mode = argv[1];
    std::string model_path, input_path, fa = "auto";
    int n_predict = 48, n_threads = 2, n_ctx = 2048;
    bool verbose = false;
    // Extra CPU buffer types (AMX / CPU_REPACK) are OFF by default: on AMX
    // machines (Sapphire Rapids) this llama.cpp build picks the AMX kernels for
    // Q4_1 and segfaults in ggml_backend_amx_mul_mat (cf. ggml-org/llama.cpp#20824).
    bool extra_bufts = false;
    for (int i = 2; i < argc; i++) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) {
                usage(argv[0]);
                exit(1);
            }
            return argv[++i];
        };
        if (a == "-m") model_path = next();
        else if (a == "-f") input_path = next();
        else if (a == "-n") n_predict = std::stoi(next());
        else if (a == "-t") n_threads = std::stoi(next());
        else if (a == "-c") n_ctx = std::stoi(next());
        else if (a == "--fa") fa = next();
        else if (a == "--extra-bufts") extra_bufts = std::stoi(next()) != 0;
        else if (a == "-v") verbose = true;
        else {
            usage(argv[0]);
            return 1;
        }
    }
    if ((mode != "generate" && mode != "tokenize") || model_path.empty() || input_path.empty()) {
        usage(argv[0]);
        return 1;
    }
    if (!verbose) {
        llama_log_set(quiet_log, nullptr);
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.use_extra_bufts = extra_bufts;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) {
        fprintf(stderr, "error: unable to load model %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const std::vector<json> inputs = read_jsonl(input_path);

    json out;
    out["tool"] = "llamacpp-greedy";
    out["mode"] = mode;
    out["llama_system_info"] = llama_print_system_info();
    out["vocab_size"] = llama_vocab_n_tokens(vocab);
    out["add_bos"] = llama_vocab_get_add_bos(vocab);
    out["add_eos"] = llama_vocab_get_add_eos(vocab);
    out["bos_id"] = llama_vocab_bos(vocab);
    out["eos_id"] = llama_vocab_eos(vocab);
    out["eot_id"] = llama_vocab_eot(vocab);
    {
        json eog = json::array();
        for (llama_token t = 0; t < llama_vocab_n_tokens(vocab); t++) {
            if (llama_vocab_is_eog(vocab, t)) eog.push_back(t);
        }
        out["eog_ids"] = eog;
    }
    out["tokenizer_model"] = model_meta(model, "tokenizer.ggml.model");
    out["tokenizer_pre"] = model_meta(model, "tokenizer.ggml.pre");

    if (mode == "tokenize") {
        out["note"] = "ids_special: add_special=false, parse_special=true; ids_no_special: add_special=false, "
                      "parse_special=false; ids_add_special: add_special=true, parse_special=true";
        json cases = json::array();
        for (const auto & in : inputs) {
            const std::string text = in.contains("text") ? in["text"].get<std::string>() : in["prompt"].get<std::string>();
            json c;
            if (in.contains("name")) c["name"] = in["name"];
            c["text"] = text;
            const auto ids_special    = tokenize(vocab, text, false, true);
            const auto ids_no_special = tokenize(vocab, text, false, false);
            const auto ids_add        = tokenize(vocab, text, true, true);
            c["ids_special"]    = ids_special;
            c["ids_no_special"] = ids_no_special;
            c["special_differs"] = ids_special != ids_no_special;
            c["ids_add_special"] = ids_add;
            json pieces = json::array();
            for (auto id : ids_special) pieces.push_back(piece(vocab, id));
            c["pieces_special"] = pieces;
            c["roundtrip_special"] = detok(vocab, ids_special) == text;
            c["roundtrip_no_special"] = detok(vocab, ids_no_special) == text;
            cases.push_back(c);
        }
        out["cases"] = cases;
    } else {
        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx           = n_ctx;
        cparams.n_batch         = n_ctx;  // whole prompt in one llama_decode call
        cparams.n_ubatch        = n_ctx;  // ... and one physical batch
        cparams.n_seq_max       = 1;
        cparams.n_threads       = n_threads;
        cparams.n_threads_batch = n_threads;
        cparams.no_perf         = true;
        cparams.flash_attn_type = fa == "on"  ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                                : fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                              : LLAMA_FLASH_ATTN_TYPE_AUTO;
        out["n_threads"] = n_threads;
        out["n_ctx"] = n_ctx;
        out["n_batch"] = n_ctx;
        out["n_ubatch"] = n_ctx;
        out["n_predict"] = n_predict;
        out["flash_attn"] = fa;
        out["use_extra_bufts"] = extra_bufts;
        out["top_logits_k"] = TOP_K;
        out["sampling"] = "argmax of llama_get_logits_ith(ctx,-1) (lowest id on ties), stop on llama_vocab_is_eog";

        const int32_t n_vocab = llama_vocab_n_tokens(vocab);
        json cases = json::array();
        for (const auto & in : inputs) {
            const std::string name   = in.value("name", "");
            const std::string prompt = in.value("prompt", std::string());
            const bool add_special   = in.value("add_special", true);
            std::vector<llama_token> prompt_ids;
            if (in.contains("prompt_ids")) {
                prompt_ids = in["prompt_ids"].get<std::vector<llama_token>>();
                for (llama_token t : prompt_ids) {
                    if (t < 0 || t >= n_vocab) {
                        fprintf(stderr, "error: prompt '%s': token id %d out of range\n", name.c_str(), t);
                        return 1;
                    }
                }
            } else {
                prompt_ids = tokenize(vocab, prompt, add_special, true);
            }
            if (prompt_ids.empty() || (int) prompt_ids.size() + n_predict > n_ctx) {
                fprintf(stderr, "error: prompt '%s' has %zu tokens\n", name.c_str(), prompt_ids.size());
                return 1;
            }
            llama_context * ctx = llama_init_from_model(model, cparams);  // fresh KV cache per case
            if (!ctx) {
                fprintf(stderr, "error: failed to create context\n");
                return 1;
            }
            std::vector<llama_token> output_ids;
            std::vector<double> margins;  // top1 - top2 logit per generated token
            json top_logits = json::array();  // per step: [[id, logit] x TOP_K]
            bool stopped = false;
            std::vector<llama_token> cur = prompt_ids;
            for (int step = 0; step < n_predict; step++) {
                if (llama_decode(ctx, llama_batch_get_one(cur.data(), (int32_t) cur.size())) != 0) {
                    fprintf(stderr, "error: llama_decode failed (case %s, step %d)\n", name.c_str(), step);
                    return 1;
                }
                const float * logits = llama_get_logits_ith(ctx, -1);
                // top-K (logit desc, id asc on ties); best = top[0] = argmax with lowest id on ties
                std::vector<int32_t> idx(n_vocab);
                for (int32_t v = 0; v < n_vocab; v++) idx[v] = v;
                std::partial_sort(idx.begin(), idx.begin() + TOP_K, idx.end(), [&](int32_t x, int32_t y) {
                    return logits[x] > logits[y] || (logits[x] == logits[y] && x < y);
                });
                const llama_token best = idx[0];
                const float b1 = logits[idx[0]], b2 = logits[idx[1]];
                json tk = json::array();
                for (int k = 0; k < TOP_K; k++) tk.push_back(json::array({idx[k], logits[idx[k]]}));
                top_logits.push_back(tk);
                output_ids.push_back(best);
                margins.push_back((double) b1 - (double) b2);
                if (llama_vocab_is_eog(vocab, best)) {
                    stopped = true;
                    break;
                }
                cur.assign(1, best);
            }
            llama_free(ctx);

            json pieces = json::array();
            for (auto id : output_ids) pieces.push_back(piece(vocab, id));
            double min_margin = INFINITY;
            for (double m : margins) min_margin = std::min(min_margin, m);

            json c;
            c["name"] = name;
            if (in.contains("kind")) c["kind"] = in["kind"];
            if (in.contains("messages")) c["messages"] = in["messages"];
            if (in.contains("prompt") || !in.contains("prompt_ids")) c["prompt"] = prompt;
            if (in.contains("add_special")) c["add_special"] = add_special;
            c["prompt_ids"] = prompt_ids;
            c["n_prompt_tokens"] = prompt_ids.size();
            c["output_ids"] = output_ids;
            const std::string text = detok(vocab, output_ids);
            c["output_text"] = text;  // invalid UTF-8 (a cut multi-byte char) is written as U+FFFD
            c["output_text_valid_utf8"] = valid_utf8(text);
            if (!valid_utf8(text)) c["output_text_hex"] = to_hex(text);
            c["output_pieces"] = pieces;
            c["stopped_at_eos"] = stopped;
            c["stop_token"] = stopped ? json(output_ids.back()) : json(nullptr);
            c["logit_margins"] = margins;
            c["min_logit_margin"] = min_margin;
            c["top_logits"] = top_logits;
            cases.push_back(c);
            fprintf(stderr, "case %-24s prompt %4zu tok, generated %2zu%s, min margin %.4f\n", name.c_str(),
                    prompt_ids.size(), output_ids.size(), stopped ? " (eos)" : "", min_margin);
        }
        out["cases"] = cases;
    }

    std::cout << out.dump(2, ' ', false, json::error_handler_t::replace) << std::endl;
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

/* Stream text from a kvforge artifact with onnxruntime-genai's C API (no kvforge code).
 *
 *   cc examples/genai/genai_stream.c -o genai_stream -L"$OGA_LIB" -lonnxruntime-genai -Wl,-rpath,"$OGA_LIB"
 *   LD_LIBRARY_PATH="$ORT_LIB" ./genai_stream ARTIFACT [PROMPT] [MAX_NEW_TOKENS]
 *
 * OGA_LIB: the directory holding libonnxruntime-genai.so, e.g. the onnxruntime_genai folder
 * of the PyPI wheel (in site-packages), or the lib/ folder of a release archive. ORT_LIB: a
 * directory where onnxruntime-genai finds onnxruntime as libonnxruntime.so.1 (the PyPI wheel
 * of onnxruntime names it libonnxruntime.so.1.X.Y in onnxruntime/capi: a symlink named
 * libonnxruntime.so.1 beside it, or in any directory, will do). tests/examples/test_genai.py
 * builds and runs it so, on the example model.
 * The functions are those of onnxruntime-genai's ort_genai_c.h, declared here so that the
 * example builds from the shared library alone; with the release's header at hand, include
 * <ort_genai_c.h> instead. Greedy decoding: the text is `kvforge generate ARTIFACT PROMPT
 * --temperature 0`'s.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct OgaResult OgaResult;
typedef struct OgaModel OgaModel;
typedef struct OgaTokenizer OgaTokenizer;
typedef struct OgaTokenizerStream OgaTokenizerStream;
typedef struct OgaSequences OgaSequences;
typedef struct OgaGeneratorParams OgaGeneratorParams;
typedef struct OgaGenerator OgaGenerator;

const char* OgaResultGetError(const OgaResult* result);
void OgaDestroyResult(OgaResult* result);
OgaResult* OgaCreateModel(const char* config_path, OgaModel** out);
void OgaDestroyModel(OgaModel* model);
OgaResult* OgaCreateTokenizer(const OgaModel* model, OgaTokenizer** out);
void OgaDestroyTokenizer(OgaTokenizer* tokenizer);
OgaResult* OgaCreateTokenizerStream(const OgaTokenizer* tokenizer, OgaTokenizerStream** out);
void OgaDestroyTokenizerStream(OgaTokenizerStream* stream);
OgaResult* OgaTokenizerStreamDecode(OgaTokenizerStream* stream, int32_t token, const char** out);
OgaResult* OgaCreateSequences(OgaSequences** out);
void OgaDestroySequences(OgaSequences* sequences);
size_t OgaSequencesGetSequenceCount(const OgaSequences* sequences, size_t sequence_index);
OgaResult* OgaTokenizerEncode(const OgaTokenizer* tokenizer, const char* str, OgaSequences* sequences);
OgaResult* OgaCreateGeneratorParams(const OgaModel* model, OgaGeneratorParams** out);
void OgaDestroyGeneratorParams(OgaGeneratorParams* params);
OgaResult* OgaGeneratorParamsSetSearchNumber(OgaGeneratorParams* params, const char* name, double value);
OgaResult* OgaGeneratorParamsSetSearchBool(OgaGeneratorParams* params, const char* name, bool value);
OgaResult* OgaCreateGenerator(const OgaModel* model, const OgaGeneratorParams* params, OgaGenerator** out);
void OgaDestroyGenerator(OgaGenerator* generator);
OgaResult* OgaGenerator_AppendTokenSequences(OgaGenerator* generator, const OgaSequences* sequences);
bool OgaGenerator_IsDone(OgaGenerator* generator);
OgaResult* OgaGenerator_GenerateNextToken(OgaGenerator* generator);
OgaResult* OgaGenerator_GetNextTokens(const OgaGenerator* generator, const int32_t** out, size_t* out_count);

/* Every call returns NULL or an error, which ends the program with onnxruntime-genai's message. */
static void check(OgaResult* result) {
  if (result != NULL) {
    fprintf(stderr, "onnxruntime-genai: %s\n", OgaResultGetError(result));
    OgaDestroyResult(result);
    exit(1);
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s ARTIFACT [PROMPT] [MAX_NEW_TOKENS]\n", argv[0]);
    return 2;
  }
  const char* prompt = argc > 2 ? argv[2] : "def read_config(path):";
  int new_tokens = argc > 3 ? atoi(argv[3]) : 64;

  OgaModel* model;
  OgaTokenizer* tokenizer;
  OgaTokenizerStream* stream;
  OgaSequences* ids;
  OgaGeneratorParams* params;
  OgaGenerator* generator;
  check(OgaCreateModel(argv[1], &model));
  check(OgaCreateTokenizer(model, &tokenizer));
  check(OgaCreateTokenizerStream(tokenizer, &stream));
  check(OgaCreateSequences(&ids));
  check(OgaTokenizerEncode(tokenizer, prompt, ids));

  check(OgaCreateGeneratorParams(model, &params));
  check(OgaGeneratorParamsSetSearchNumber(params, "max_length", (double)(OgaSequencesGetSequenceCount(ids, 0) + new_tokens)));
  check(OgaGeneratorParamsSetSearchBool(params, "do_sample", false));
  check(OgaCreateGenerator(model, params, &generator));
  check(OgaGenerator_AppendTokenSequences(generator, ids));
  while (!OgaGenerator_IsDone(generator)) {
    const int32_t* tokens;
    size_t count;
    const char* text;
    check(OgaGenerator_GenerateNextToken(generator));
    check(OgaGenerator_GetNextTokens(generator, &tokens, &count));
    check(OgaTokenizerStreamDecode(stream, tokens[0], &text));
    fputs(text, stdout);
    fflush(stdout);
  }
  fputc('\n', stdout);

  OgaDestroyGenerator(generator);
  OgaDestroyGeneratorParams(params);
  OgaDestroySequences(ids);
  OgaDestroyTokenizerStream(stream);
  OgaDestroyTokenizer(tokenizer);
  OgaDestroyModel(model);
  return 0;
}

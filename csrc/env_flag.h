// moegemm's boolean environment variables on the C++ side, with the rule of moegemm/_env.py: 1/0, true/false,
// yes/no, on/off (any case, surrounding blanks ignored); unset or empty is the default; anything else throws
// std::invalid_argument naming the variable (so that "false" never reads as on). Host code only, no CUDA header.
#pragma once

#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace moegemm {

inline bool parse_env_flag(const char* env, const char* value, bool default_value) {
  if (value == nullptr) return default_value;
  std::string v(value);
  const auto first = v.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return default_value;
  v = v.substr(first, v.find_last_not_of(" \t\r\n") - first + 1);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw std::invalid_argument(std::string("environment variable ") + env + "='" + value +
                              "' is not a boolean: use one of 1/true/yes/on or 0/false/no/off (any case), or leave "
                              "it unset");
}

// The boolean environment variable `env`, `default_value` when unset or empty.
inline bool env_flag(const char* env, bool default_value) {
  return parse_env_flag(env, std::getenv(env), default_value);
}

}  // namespace moegemm
